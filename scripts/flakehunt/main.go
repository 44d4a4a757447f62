// Command flakehunt runs a test suite N times, optionally beside a CPU hog, and prints how often each test
// failed: the figure that says whether the suite is green every time or only most times.
//
//	go run ./scripts/flakehunt -runs 20 ./...
//	go run ./scripts/flakehunt -runs 5 -hog 2 -- -race ./services/fleet/
//	go tool task test:flakehunt RUNS=20 HOG=2
//
// Everything after the flags (or after --) is passed to `go test -json -count=1`. A test that failed has its
// own output kept under -out, one file per failure (run, package, test), so a rare failure can be read after
// the series. The CPU hog is -hog processes, each spinning on a core at normal priority as a busy neighbour
// would; they end with the series (and with a killed hunt).
// The exit status is 1 when any run failed.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"
)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action  string
	Package string
	Test    string
	Output  string
	Elapsed float64
}

// key names a test, or a package's own failure (a build error, a panic outside a test, a timeout) when Test
// is empty.
type key struct{ pkg, test string }

func (k key) String() string {
	if k.test == "" {
		return k.pkg + " (package)"
	}
	return k.pkg + " " + k.test
}

func main() {
	if len(os.Args) == 2 && os.Args[1] == "-spin" {
		spin()
	}
	runs := flag.Int("runs", 10, "how many times to run the suite")
	hog := flag.Int("hog", 0, "CPU hog processes to run beside the suite (each spins on a core)")
	out := flag.String("out", "", "directory for the output of each failed test (default: a new temporary directory)")
	stop := flag.Bool("stop", false, "stop at the first failed run")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: flakehunt [-runs N] [-hog K] [-out DIR] [-stop] [--] [go test flags] [packages]\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	args := flag.Args()
	if len(args) == 0 {
		args = []string{"./..."}
	}
	if *runs < 1 {
		fmt.Fprintln(os.Stderr, "flakehunt: -runs must be at least 1")
		os.Exit(2)
	}
	if *out == "" {
		dir, err := os.MkdirTemp("", "flakehunt-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "flakehunt:", err)
			os.Exit(2)
		}
		*out = dir
	} else if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, "flakehunt:", err)
		os.Exit(2)
	}

	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	stopHog, err := startHog(*hog)
	if err != nil {
		fmt.Fprintln(os.Stderr, "flakehunt:", err)
		os.Exit(2)
	}
	defer stopHog()

	fmt.Printf("flakehunt: %d run(s) of go test -json -count=1 %s, %d hog process(es) beside it; failures under %s\n",
		*runs, strings.Join(args, " "), *hog, *out)
	failures := map[key]int{}
	seen := map[key]bool{}
	failedRuns := 0
	start := time.Now()
	done := 0
	for i := 1; i <= *runs; i++ {
		res, err := runOnce(ctx, i, args, *out)
		if err != nil {
			fmt.Fprintf(os.Stderr, "flakehunt: run %d: %v\n", i, err)
			break
		}
		done++
		for k := range res.ran {
			seen[k] = true
		}
		status := "ok"
		if len(res.failed) > 0 || res.exit != 0 {
			failedRuns++
			status = "FAIL"
		}
		names := make([]string, 0, len(res.failed))
		for k := range res.failed {
			failures[k]++
			names = append(names, k.String())
		}
		sort.Strings(names)
		line := fmt.Sprintf("run %d/%d: %s in %s", i, *runs, status, res.took.Round(time.Second))
		if len(names) > 0 {
			line += ": " + strings.Join(names, ", ")
		} else if res.exit != 0 {
			line += fmt.Sprintf(": go test exited %d with no failed test named (see %s)", res.exit, res.log)
		}
		fmt.Println(line)
		if *stop && status == "FAIL" {
			break
		}
	}

	fmt.Printf("\nflakehunt: %d of %d run(s) failed, %d test(s) seen, %s in all\n", failedRuns, done, len(seen),
		time.Since(start).Round(time.Second))
	if len(failures) > 0 {
		keys := make([]key, 0, len(failures))
		for k := range failures {
			keys = append(keys, k)
		}
		sort.Slice(keys, func(a, b int) bool {
			if failures[keys[a]] != failures[keys[b]] {
				return failures[keys[a]] > failures[keys[b]]
			}
			return keys[a].String() < keys[b].String()
		})
		fmt.Printf("%-8s %s\n", "failed", "test")
		for _, k := range keys {
			fmt.Printf("%-8s %s\n", fmt.Sprintf("%d/%d", failures[k], done), k)
		}
	}
	if failedRuns > 0 || done < *runs {
		os.Exit(1)
	}
}

type result struct {
	ran    map[key]bool
	failed map[key]bool
	exit   int
	took   time.Duration
	log    string
}

// runOnce runs go test once and reads its events: which tests ran and which failed, with each failed test's
// output written to its own file.
func runOnce(ctx context.Context, run int, args []string, out string) (result, error) {
	res := result{ran: map[key]bool{}, failed: map[key]bool{}}
	res.log = filepath.Join(out, fmt.Sprintf("run-%03d.jsonl", run))
	logf, err := os.Create(res.log)
	if err != nil {
		return res, err
	}
	defer logf.Close()
	cmd := exec.CommandContext(ctx, "go", append([]string{"test", "-json", "-count=1"}, args...)...)
	cmd.Stderr = logf // build errors come on stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return res, err
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return res, err
	}
	outputs := map[key]*strings.Builder{}
	sc := bufio.NewScanner(io.TeeReader(stdout, logf))
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		var ev event
		if json.Unmarshal(sc.Bytes(), &ev) != nil {
			continue // go test's own non-JSON lines (a build failure's "FAIL pkg [build failed]")
		}
		k := key{ev.Package, ev.Test}
		switch ev.Action {
		case "output":
			b := outputs[k]
			if b == nil {
				b = &strings.Builder{}
				outputs[k] = b
			}
			if b.Len() < 4<<20 {
				b.WriteString(ev.Output)
			}
		case "pass", "skip":
			res.ran[k] = true
			delete(outputs, k)
		case "fail":
			res.ran[k] = true
			// A parent test fails with its failed subtest, and a package with its failed test: count the
			// innermost failure only.
			if hasFailedChild(res.failed, k) {
				continue
			}
			res.failed[k] = true
			name := fmt.Sprintf("run-%03d-%s-%s.log", run, sanitize(ev.Package), sanitize(ev.Test))
			if b := outputs[k]; b != nil {
				_ = os.WriteFile(filepath.Join(out, name), []byte(b.String()), 0o644)
			}
		}
	}
	err = cmd.Wait()
	res.took = time.Since(start)
	if ctx.Err() != nil {
		return res, ctx.Err()
	}
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		res.exit = exitErr.ExitCode()
	} else if err != nil {
		return res, err
	}
	return res, nil
}

// hasFailedChild reports whether a subtest of k (or, for a package, a test of it) is already counted.
func hasFailedChild(failed map[key]bool, k key) bool {
	for f := range failed {
		if f.pkg != k.pkg {
			continue
		}
		if k.test == "" || strings.HasPrefix(f.test, k.test+"/") {
			return true
		}
	}
	return false
}

func sanitize(s string) string {
	if s == "" {
		return "package"
	}
	return strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_', r == '.':
			return r
		}
		return '_'
	}, s)
}

// startHog starts n processes that each spin on a core, and returns what stops them.
func startHog(n int) (func(), error) {
	if n <= 0 {
		return func() {}, nil
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	var procs []*exec.Cmd
	stop := func() {
		for _, p := range procs {
			_ = p.Process.Kill()
			_ = p.Wait()
		}
	}
	for range n {
		p := exec.Command(self, "-spin")
		p.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} // no hog outlives a killed hunt
		if err := p.Start(); err != nil {
			stop()
			return nil, fmt.Errorf("start a CPU hog: %w", err)
		}
		procs = append(procs, p)
	}
	return stop, nil
}

// spin is a hog process: one goroutine busy forever.
func spin() {
	x := 0
	for {
		x++
	}
}
