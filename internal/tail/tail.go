package tail

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
)

// blockSize is how much FindTailLineStartIndex reads per step backwards, as the kubelet's.
const blockSize = 1024

var eol = []byte{'\n'}

// FindTailLineStartIndex returns the byte offset in f where the n-th line from the end starts, reading f
// backwards in blocks of 1 KiB until more than n newlines were seen or the start was reached.
//
// As the kubelet's: n < 0 gives 0; an unterminated last line is not counted as a line (so n = 0 gives the
// offset just after the last newline); asking for more lines than exist gives 0.
func FindTailLineStartIndex(f io.ReadSeeker, n int64) (int64, error) {
	if n < 0 {
		return 0, nil
	}
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("seek to end: %w", err)
	}
	var left, cnt int64
	buf := make([]byte, blockSize)
	for right := size; right > 0 && cnt <= n; right -= blockSize {
		left = right - blockSize
		if left < 0 {
			left = 0
			buf = make([]byte, right)
		}
		if _, err := f.Seek(left, io.SeekStart); err != nil {
			return 0, fmt.Errorf("seek to %d: %w", left, err)
		}
		if _, err := io.ReadFull(f, buf); err != nil {
			return 0, fmt.Errorf("read at %d: %w", left, err)
		}
		cnt += int64(bytes.Count(buf, eol))
	}
	for ; cnt > n; cnt-- {
		idx := bytes.Index(buf, eol) + 1
		buf = buf[idx:]
		left += int64(idx)
	}
	return left, nil
}

// Lines returns the last n lines of the file at path (fewer when it has fewer; n < 0: none), each without
// its newline. An unterminated last line (a write in progress) is left out. Only the tail is read.
func Lines(path string, n int64) ([][]byte, error) {
	if n <= 0 {
		return nil, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	// The n-th line from the end counting the unterminated one (n = 0 is the unterminated line itself), so
	// asking for n finds the start of the n-th complete line from the end.
	start, err := FindTailLineStartIndex(f, n)
	if err != nil {
		return nil, fmt.Errorf("tail %s: %w", path, err)
	}
	if _, err := f.Seek(start, io.SeekStart); err != nil {
		return nil, fmt.Errorf("tail %s: %w", path, err)
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return nil, fmt.Errorf("tail %s: %w", path, err)
	}
	if i := bytes.LastIndexByte(data, '\n'); i >= 0 {
		data = data[:i]
	} else {
		return nil, nil
	}
	lines := bytes.Split(data, eol)
	if int64(len(lines)) > n {
		lines = lines[int64(len(lines))-n:]
	}
	return lines, nil
}

// ReadAtMost reads at most max bytes from the end of the file at path; longerThanMax reports that the file
// holds more. As the kubelet's: a size-0 file gives (nil, false, nil) and max <= 0 gives empty data and true.
func ReadAtMost(path string, max int64) ([]byte, bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, false, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, false, err
	}
	size := fi.Size()
	if size == 0 {
		return nil, false, nil
	}
	if size < max {
		max = size
	}
	offset, err := f.Seek(-max, io.SeekEnd)
	if err != nil {
		return nil, false, err
	}
	data, err := io.ReadAll(f)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, false, err
	}
	return data, offset > 0, nil
}
