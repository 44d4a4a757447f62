package integration_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/integration/kubelab"
	"github.com/imagefleet/imagefleet/internal/testenv"
)

// BenchmarkControllerObjects runs a fleet GC dry run and a pre-pull through the objects (ImageGC,
// ImagePrePull, the controller on a real kube-apiserver) beside the same rollout from the CLI, in the same
// run, on hollow agents with their real workers on a three-server NATS cluster. Rows: the scale
// benchmarks' nodes=N/streams=S (fleetSizes, streamRows; 1,000 nodes on R3 streams by default). Per object
// it reports the time from create to Complete, the status writes and the bytes of the final status, and
// the controller's peak memory; the CLI's wall time is the baseline (ratio = object / CLI).
func BenchmarkControllerObjects(b *testing.B) {
	raiseNoFile(b)
	bin := imagefleetBinary(b)
	for _, nr := range testenv.Rows(fleetSizes) {
		for _, sr := range testenv.Rows(streamRows) {
			benchControllerObjects(b, bin, nr.Name+"/"+sr.Name, nr.Value, sr.Value)
		}
	}
}

// benchControllerObjects runs BenchmarkControllerObjects's row name: n agents on a cluster of s.
func benchControllerObjects(b *testing.B, bin, name string, n int, s clusterStreams) {
	b.Run(name, func(b *testing.B) {
		kc := kubelab.StartT(b, kubelab.Options{})
		cl := controllerClient(b, kc.AdminConfig())
		applyCRDs(b, cl)
		f := startHollowFleet(b, bin, n, s, "--images-per-node", "2", "--pull-delay", "100ms")
		port := freePort(b)
		ctl := startProc(b, "controller", bin, "agent", "--node", "ctl", "--workers", "controller,metrics",
			"--metrics-addr", fmt.Sprintf("127.0.0.1:%d", port), "--nats", f.c.URL, "--stream-replicas", strconv.Itoa(s.replicas),
			"--kubeconfig", kc.KubeconfigPath("admin"), "--controller-namespace", "default", "--data-dir", b.TempDir(), "--no-journal")
		waitLogLine(b, ctl, "agent ready", time.Minute)
		metrics := fmt.Sprintf("http://127.0.0.1:%d/metrics", port)

		for i, op := range []struct {
			name string
			cli  []string
			obj  client.Object
		}{
			{"gc-dryrun", []string{"fleet", "gc", "--dry-run"},
				&v1alpha1.ImageGC{Spec: v1alpha1.ImageGCSpec{DryRun: true}}},
			{"prepull", []string{"fleet", "pull", "--policy", "Always", "registry.example/bench:cli"},
				&v1alpha1.ImagePrePull{Spec: v1alpha1.ImagePrePullSpec{Images: []string{"registry.example/bench:object"}, PullPolicy: "Always"}}},
		} {
			var cliWall time.Duration
			b.Run("op="+op.name+"/via=cli", func(b *testing.B) {
				rc := f.run(b, bin, op.cli...)
				cliWall = rc.wall
				b.ReportMetric(rc.wall.Seconds(), "s")
			})
			b.Run("op="+op.name+"/via=object", func(b *testing.B) {
				kind := "imagegc"
				if _, ok := op.obj.(*v1alpha1.ImagePrePull); ok {
					kind = "imageprepull"
				}
				w0 := scrapeCounter(b, metrics, `imagefleet_controller_status_writes_total{kind="`+kind+`"}`)
				op.obj.SetName(fmt.Sprintf("bench-%d", i))
				began := time.Now()
				if err := cl.Create(b.Context(), op.obj); err != nil {
					b.Fatal(err)
				}
				st := waitConditionWithin(b, cl, op.obj, v1alpha1.ConditionComplete, time.Duration(n/20+120)*time.Second)
				wall := time.Since(began)
				writes := scrapeCounter(b, metrics, `imagefleet_controller_status_writes_total{kind="`+kind+`"}`) - w0
				raw, err := json.Marshal(st)
				if err != nil {
					b.Fatal(err)
				}
				ps, err := readProcStat(ctl.cmd.Process.Pid)
				if err != nil {
					b.Fatal(err)
				}
				if st.Succeeded != int32(n) {
					b.Fatalf("%s: %d of %d succeeded: %+v", op.obj.GetName(), st.Succeeded, n, st)
				}
				b.ReportMetric(wall.Seconds(), "s")
				b.ReportMetric(wall.Seconds()/cliWall.Seconds(), "x-cli")
				b.ReportMetric(writes, "status-writes")
				b.ReportMetric(float64(len(raw)), "status-bytes")
				b.ReportMetric(float64(ps.HWM)/(1<<20), "controller-MiB")
				b.Logf("%s nodes=%d: object %s to Complete (CLI %s, x%.2f), %.0f status writes, %d status bytes, waves %v, controller peak %.0f MiB",
					op.name, n, wall.Round(10*time.Millisecond), cliWall.Round(10*time.Millisecond), wall.Seconds()/cliWall.Seconds(),
					writes, len(raw), st.Waves, float64(ps.HWM)/(1<<20))
			})
		}
	})
}

// scrapeCounter reads one series' value from a Prometheus text page (0 when absent).
func scrapeCounter(b testing.TB, url, series string) float64 {
	b.Helper()
	resp, err := http.Get(url)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatalf("%s: %v", series, err)
			}
			return f
		}
	}
	return 0
}
