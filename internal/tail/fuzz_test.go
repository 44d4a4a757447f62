package tail

import (
	"bytes"
	"testing"
)

// naiveStart is FindTailLineStartIndex by reading the whole input: the offset after the (n+1)-th newline from
// the end, or 0.
func naiveStart(data []byte, n int64) int64 {
	if n < 0 {
		return 0
	}
	seen := int64(0)
	for i := len(data) - 1; i >= 0; i-- {
		if data[i] == '\n' {
			seen++
			if seen == n+1 {
				return int64(i) + 1
			}
		}
	}
	return 0
}

func FuzzFindTailLineStartIndex(f *testing.F) {
	f.Add(content(), int64(1))
	f.Add([]byte("a\nb\nc"), int64(0))
	f.Add([]byte(""), int64(3))
	f.Add(bytes.Repeat([]byte("x\n"), 700), int64(600))
	f.Fuzz(func(t *testing.T, data []byte, n int64) {
		if n > 1<<20 {
			n = 1 << 20
		}
		got, err := FindTailLineStartIndex(bytes.NewReader(data), n)
		if err != nil {
			t.Fatal(err)
		}
		if want := naiveStart(data, n); got != want {
			t.Fatalf("FindTailLineStartIndex(%d bytes, n=%d) = %d, want %d", len(data), n, got, want)
		}
	})
}
