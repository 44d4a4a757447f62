package journal

import (
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/imagefleet/imagefleet/events"
)

// FuzzJournalRecovery: whatever a crash or a disk left in the journal file and its cursor, recovery never
// panics, keeps only whole lines, and every pending entry is a valid event inside the file.
func FuzzJournalRecovery(f *testing.F) {
	ev, err := events.New("node-a", "image", "detected", map[string]string{"id": "sha256:1"})
	if err != nil {
		f.Fatal(err)
	}
	line, err := json.Marshal(ev)
	if err != nil {
		f.Fatal(err)
	}
	line = append(line, '\n')
	f.Add(line, []byte(`{"first":"`+ev.ID+`","offset":0}`))
	f.Add(append(append([]byte{}, line...), line[:10]...), []byte(`{"first":"`+ev.ID+`","offset":5}`))
	f.Add([]byte("not json\n"+string(line)), []byte(`{"offset":-3}`))
	f.Add([]byte{}, []byte(`garbage`))
	f.Fuzz(func(t *testing.T, file, cursor []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, File), file, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, cursorFile), cursor, 0o600); err != nil {
			t.Fatal(err)
		}
		j := &Journal{cfg: Config{Dir: dir}, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
		if err := j.load(); err != nil {
			return // an error is a clear refusal; a panic is the bug
		}
		defer func() { _ = j.f.Close() }()
		if j.size > int64(len(file)) || (j.size > 0 && file[j.size-1] != '\n') {
			t.Fatalf("kept %d bytes of %d, not ending a line", j.size, len(file))
		}
		if j.acked < 0 || j.acked > j.size {
			t.Fatalf("cursor %d outside the kept file of %d bytes", j.acked, j.size)
		}
		for _, e := range j.pending {
			if e.end > j.size || e.ev.ID == "" || e.ev.Type == "" {
				t.Fatalf("pending entry %+v (file %d bytes)", e.ev, j.size)
			}
		}
	})
}
