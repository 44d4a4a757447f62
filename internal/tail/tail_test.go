package tail

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// content is the kubelet's test file: four lines of 1024 'a' and a newline, then 512 'a' with no newline
// (4612 bytes).
func content() []byte {
	line := strings.Repeat("a", blockSize) + "\n"
	return []byte(strings.Repeat(line, 4) + strings.Repeat("a", blockSize/2))
}

// TestTail is the older pkg/util/tail TestTail (FindTailLineStartIndex), case for case.
func TestTail(t *testing.T) {
	data := content()
	if len(data) != 4612 {
		t.Fatalf("content is %d bytes, want 4612", len(data))
	}
	for _, tc := range []struct {
		name  string
		n     int64
		start int64
	}{
		{name: "n=-1", n: -1, start: 0},
		{name: "n=0", n: 0, start: 4100},
		{name: "n=1", n: 1, start: 3075},
		{name: "n=9999", n: 9999, start: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := FindTailLineStartIndex(bytes.NewReader(data), tc.n)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.start {
				t.Errorf("FindTailLineStartIndex(n=%d) = %d, want %d", tc.n, got, tc.start)
			}
		})
	}
}

func TestFindTailLineStartIndexEdges(t *testing.T) {
	for _, tc := range []struct {
		name, data string
		n, start   int64
	}{
		{name: "empty file", data: "", n: 0, start: 0},
		{name: "empty file n=3", data: "", n: 3, start: 0},
		{name: "one terminated line n=0", data: "x\n", n: 0, start: 2},
		{name: "one terminated line n=1", data: "x\n", n: 1, start: 0},
		{name: "three lines n=2", data: "a\nbb\nccc\n", n: 2, start: 2},
		{name: "newline at a block edge", data: strings.Repeat("b", 1023) + "\n" + "c\n", n: 1, start: 1024},
		{name: "lines exactly n", data: "a\nb\n", n: 2, start: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := FindTailLineStartIndex(strings.NewReader(tc.data), tc.n)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.start {
				t.Errorf("FindTailLineStartIndex(%q, %d) = %d, want %d", tc.data, tc.n, got, tc.start)
			}
		})
	}
}

func writeFile(t *testing.T, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReadAtMost is pkg/util/tail TestReadAtMost, case for case.
func TestReadAtMost(t *testing.T) {
	data := content()
	p := writeFile(t, data)
	for _, tc := range []struct {
		name   string
		max    int64
		want   string
		longer bool
	}{
		{name: "the max is negative", max: -1, want: "", longer: true},
		{name: "the max is zero", max: 0, want: "", longer: true},
		{name: "the file length is longer than max", max: 1, want: "a", longer: true},
		{name: "the file length is longer than max and contains newlines", max: 1024,
			want: strings.Repeat("a", 511) + "\n" + strings.Repeat("a", 512), longer: true},
		{name: "the max is longer than file length", max: 4613, want: string(data), longer: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, longer, err := ReadAtMost(p, tc.max)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want || longer != tc.longer {
				t.Errorf("ReadAtMost(%d) = %d bytes, %v; want %d bytes, %v", tc.max, len(got), longer, len(tc.want), tc.longer)
			}
		})
	}
}

func TestReadAtMostEmptyAndMissing(t *testing.T) {
	got, longer, err := ReadAtMost(writeFile(t, nil), 10)
	if err != nil || got != nil || longer {
		t.Errorf("empty file: %q, %v, %v; want nil, false, nil", got, longer, err)
	}
	if _, _, err := ReadAtMost(filepath.Join(t.TempDir(), "missing"), 10); !os.IsNotExist(err) {
		t.Errorf("missing file: err %v, want not-exist", err)
	}
}

func TestLines(t *testing.T) {
	for _, tc := range []struct {
		name, data string
		n          int64
		want       []string
	}{
		{name: "last two", data: "1\n2\n3\n", n: 2, want: []string{"2", "3"}},
		{name: "unterminated last line left out", data: "1\n2\n3", n: 2, want: []string{"1", "2"}},
		{name: "more than exist", data: "1\n2\n", n: 10, want: []string{"1", "2"}},
		{name: "zero", data: "1\n2\n", n: 0, want: nil},
		{name: "negative", data: "1\n2\n", n: -1, want: nil},
		{name: "only an unterminated line", data: "partial", n: 3, want: nil},
		{name: "across blocks", data: strings.Repeat("x", 3000) + "\n" + "y\n", n: 1, want: []string{"y"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lines, err := Lines(writeFile(t, []byte(tc.data)), tc.n)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, l := range lines {
				got = append(got, string(l))
			}
			if strings.Join(got, "|") != strings.Join(tc.want, "|") || len(got) != len(tc.want) {
				t.Errorf("Lines(%q, %d) = %q, want %q", tc.data, tc.n, got, tc.want)
			}
		})
	}
}

// TestLinesLargeFile: the last line of a large file is found reading a few blocks, not the file.
func TestLinesLargeFile(t *testing.T) {
	var b bytes.Buffer
	for i := 0; i < 200000; i++ {
		b.WriteString("line of some length to make the file a few megabytes\n")
	}
	b.WriteString("last\n")
	r := &countingReader{r: bytes.NewReader(b.Bytes())}
	start, err := FindTailLineStartIndex(r, 1)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(b.Bytes()[start:]); got != "last\n" {
		t.Errorf("tail = %q, want %q", got, "last\n")
	}
	if r.read > 4*blockSize {
		t.Errorf("read %d bytes of %d to find the last line, want at most %d", r.read, b.Len(), 4*blockSize)
	}
}

type countingReader struct {
	r    *bytes.Reader
	read int
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.read += n
	return n, err
}

func (c *countingReader) Seek(off int64, whence int) (int64, error) { return c.r.Seek(off, whence) }
