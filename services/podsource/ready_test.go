package podsource

import (
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	podsv1alpha1 "k8s.io/kubelet/pkg/apis/pods/v1alpha1"

	"github.com/imagefleet/imagefleet/bus/bustest"
)

// TestKubeletSourceReadyOnceSynced: without a kubelet the source retries and Ready stays open; once the
// kubelet serves, Ready closes only after the initial pods were published.
func TestKubeletSourceReadyOnceSynced(t *testing.T) {
	_, b := bustest.Start(t)
	startIndex(t, b)
	dir, err := os.MkdirTemp("/tmp", "ifl-ps-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	sock := filepath.Join(dir, "pods-api.sock")
	pub := &countingPub{b: b, n: map[string]int{}}
	src, err := NewKubeletSource(KubeletConfig{Node: testNode, Socket: sock, RetryMin: 20 * time.Millisecond, RetryMax: 50 * time.Millisecond}, pub, b)
	if err != nil {
		t.Fatal(err)
	}
	connects := sourceErrors.WithLabelValues(testNode, "kubelet", "connect")
	before := testutil.ToFloat64(connects)
	bustest.RunFunc(t, "src", src.Run)
	bustest.WaitFor(t, "two failed connections", func() bool { return testutil.ToFloat64(connects) >= before+2 })
	select {
	case <-src.Ready():
		t.Fatal("ready with no kubelet")
	default:
	}
	s := &podsServer{pods: map[string][]byte{}, watchers: map[chan *podsv1alpha1.WatchPodsEvent]chan struct{}{}}
	s.set(t, apiPod("ns1", "a", "uid-a"), true)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	podsv1alpha1.RegisterPodsServer(gs, s)
	go func() { _ = gs.Serve(ln) }()
	defer gs.Stop()
	bustest.WaitClosed(t, "the source ready after the kubelet came up", src.Ready())
	wantCounts(t, "initial pods once ready", pub.take(), 1, 0, 0)
}
