package kubelab

import (
	"path/filepath"
	"testing"

	"github.com/imagefleet/imagefleet/integration/lab"
)

// StartT starts a lab cluster for a test and stops it when the test ends. It fails the test (never skips)
// when the binaries are missing or a part does not come up, with the part's log tail.
func StartT(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if opts.Log == nil {
		opts.Log = tWriter{t}
	}
	c, err := Start(t.Context(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("kubelab: stop: %v", err)
		}
	})
	return c
}

// StartWithKubelet starts a lab cluster with a kubelet on ctr, integration/lab's private containerd (start it
// with a SandboxImage). The cluster's cleanup runs before ctr's (t.Cleanup is last in, first out), so the
// kubelet is gone before containerd stops.
func StartWithKubelet(t testing.TB, ctr *lab.Containerd, opts Options) *Cluster {
	t.Helper()
	opts.CRIEndpoint = ctr.Endpoint()
	opts.CNIDir = filepath.Join(ctr.Dir(), "cni")
	return StartT(t, opts)
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Log(string(b[:len(b)-min(len(b), 1)]))
	return len(b), nil
}
