package integration_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/bus/bustest"
)

// A benchmark of horizontal scaling on a 2-core machine cannot give each replica the core a separate host
// would: the replicas and the servers share two. cpuCap holds a process to a fixed share of one core (a
// Linux CPU cgroup of its own, as a container's CPU limit would), so with every replica capped well below
// what the servers leave, the replicas are the bound and their rate can be read against their number.

// cpuCapPeriod is the cgroup's quota period (the kernel's default).
const cpuCapPeriod = 100 * time.Millisecond

// parseCPUCap reads a share of one core ("0.1", "0.25"): 0 (no cap) when raw is empty, an error outside
// (0, 1] or when it is not a number.
func parseCPUCap(raw string) (float64, error) {
	if raw == "" {
		return 0, nil
	}
	f, err := strconv.ParseFloat(strings.TrimSpace(raw), 64)
	if err != nil || !(f > 0 && f <= 1) {
		return 0, fmt.Errorf("%q: want a share of one core in (0, 1], such as 0.1", raw)
	}
	return f, nil
}

// cpuCgroup is a CPU cgroup made for one process, removed at the test's end.
type cpuCgroup struct {
	dir string
	v2  bool
}

// capCPU moves the running process pid (all its threads) into a new CPU cgroup that holds it to share of one
// core: cgroup v2's cpu.max where the unified hierarchy has the cpu controller, else v1's cpu.cfs_quota_us.
// The group is made under the hierarchy's root; with v2 the root must be able to hand the cpu controller to
// its children (a host; in a container with a cgroup namespace of its own, its root holds processes and the
// kernel refuses, EBUSY). It fails the test when the group cannot be made (not root, no cpu controller): a
// capped run that is not capped would measure something else.
func capCPU(t testing.TB, pid int, share float64) *cpuCgroup {
	t.Helper()
	quota := int64(share * float64(cpuCapPeriod/time.Microsecond))
	name := fmt.Sprintf("imagefleet-bench-%d-%d", os.Getpid(), pid)
	var cg *cpuCgroup
	var files [][2]string
	if ctl, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil && slices.Contains(strings.Fields(string(ctl)), "cpu") {
		// v2: the root must hand the cpu controller to its children.
		if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+cpu"), 0); err != nil {
			t.Fatalf("cgroup v2: enable the cpu controller for children: %v", err)
		}
		cg = &cpuCgroup{dir: filepath.Join("/sys/fs/cgroup", name), v2: true}
		files = [][2]string{{"cpu.max", fmt.Sprintf("%d %d", quota, cpuCapPeriod/time.Microsecond)}}
	} else if _, err := os.Stat("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"); err == nil {
		cg = &cpuCgroup{dir: filepath.Join("/sys/fs/cgroup/cpu", name)}
		files = [][2]string{
			{"cpu.cfs_period_us", strconv.FormatInt(int64(cpuCapPeriod/time.Microsecond), 10)},
			{"cpu.cfs_quota_us", strconv.FormatInt(quota, 10)},
		}
	} else {
		t.Fatalf("cap pid %d at %.2f core: no CPU cgroup (neither /sys/fs/cgroup/cgroup.controllers with cpu nor /sys/fs/cgroup/cpu)", pid, share)
	}
	removeStaleGroups(filepath.Dir(cg.dir))
	home := filepath.Dir(cg.dir)
	if path, ok := cpuCgroupOf(pid, cg.v2); ok {
		home = filepath.Join(filepath.Dir(cg.dir), path)
	}
	if err := os.Mkdir(cg.dir, 0o755); err != nil {
		t.Fatalf("cap pid %d at %.2f core: %v (the benchmark needs root for a CPU cap)", pid, share, err)
	}
	t.Cleanup(func() {
		// A cgroup is removed only once empty, and this cleanup runs before the one that stops the process
		// (started first, so cleaned up last): the process goes back to the group it came from first.
		_ = os.WriteFile(filepath.Join(home, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0)
		for range 50 {
			if os.Remove(cg.dir) == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Logf("cgroup %s not removed", cg.dir)
	})
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(cg.dir, f[0]), []byte(f[1]), 0); err != nil {
			t.Fatalf("cap pid %d: write %s: %v", pid, f[0], err)
		}
	}
	if err := os.WriteFile(filepath.Join(cg.dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		t.Fatalf("cap pid %d: move it into %s: %v", pid, cg.dir, err)
	}
	return cg
}

// cpuCgroupOf returns pid's CPU cgroup path from /proc/<pid>/cgroup: v2's "0::" line, or the v1 line whose
// controllers include cpu.
func cpuCgroupOf(pid int, v2 bool) (string, bool) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return "", false
	}
	for _, l := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		parts := strings.SplitN(l, ":", 3)
		if len(parts) != 3 {
			continue
		}
		if (v2 && parts[0] == "0" && parts[1] == "") || (!v2 && slices.Contains(strings.Split(parts[1], ","), "cpu")) {
			return parts[2], true
		}
	}
	return "", false
}

// removeStaleGroups removes the empty groups an earlier benchmark process left under root (killed before its
// cleanup ran): imagefleet-bench-<its pid>-..., the process gone.
func removeStaleGroups(root string) {
	dirs, _ := filepath.Glob(filepath.Join(root, "imagefleet-bench-*"))
	for _, d := range dirs {
		owner, _, _ := strings.Cut(strings.TrimPrefix(filepath.Base(d), "imagefleet-bench-"), "-")
		if _, err := os.Stat("/proc/" + owner); err != nil {
			_ = os.Remove(d) // only an empty group goes
		}
	}
}

// throttled returns how long the kernel held the group's process back for its quota (cpu.stat's
// throttled_time in v1, throttled_usec in v2): more than zero shows the cap acted. The kernel sums it over
// the CPUs the group's threads were held back on, so it can exceed the wall time: compare it between
// replicas, not with the wall time.
func (cg *cpuCgroup) throttled() (time.Duration, error) {
	raw, err := os.ReadFile(filepath.Join(cg.dir, "cpu.stat"))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(raw), "\n") {
		k, v, ok := strings.Cut(l, " ")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		if err != nil {
			continue
		}
		switch {
		case k == "throttled_time" && !cg.v2:
			return time.Duration(n), nil
		case k == "throttled_usec" && cg.v2:
			return time.Duration(n) * time.Microsecond, nil
		}
	}
	return 0, fmt.Errorf("%s/cpu.stat: no throttled time in %q", cg.dir, raw)
}

// TestCPUCapHoldsABusyProcess: a process spinning on a core, capped at 0.2 core, uses no more than its share
// and is throttled; the cap's values are parsed or refused.
func TestCPUCapHoldsABusyProcess(t *testing.T) {
	for raw, want := range map[string]float64{"": 0, "0.1": 0.1, " 1 ": 1} {
		if got, err := parseCPUCap(raw); err != nil || got != want {
			t.Errorf("parseCPUCap(%q) = %v, %v; want %v", raw, got, err, want)
		}
	}
	for _, raw := range []string{"0", "-0.5", "1.5", "a tenth", "NaN"} {
		if _, err := parseCPUCap(raw); err == nil {
			t.Errorf("parseCPUCap(%q): no error", raw)
		}
	}

	p := startProc(t, "spin", "/bin/sh", "-c", "while :; do :; done")
	cg := capCPU(t, p.cmd.Process.Pid, 0.2)
	st0, err := readProcStat(p.cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	time.Sleep(1500 * time.Millisecond) // the shortest window measured
	// On a machine busy with other work the spinner may get less than its cap for a while, and is then
	// neither throttled nor far along: the window lasts until it has run 50 ms and met its quota (a process
	// that never runs or is never throttled still fails, after a minute). The cap's bound holds over any
	// window.
	var used, wall, thr time.Duration
	bustest.Eventually(t, "the spinning process to run 50 ms of CPU and be throttled", time.Minute, func() error {
		st1, err := readProcStat(p.cmd.Process.Pid)
		wall = time.Since(t0)
		if err != nil {
			return err
		}
		used = st1.CPU - st0.CPU
		if thr, err = cg.throttled(); err != nil {
			return err
		}
		if used < 50*time.Millisecond || thr == 0 {
			return fmt.Errorf("used %s of CPU in %s, throttled %s", used, wall.Round(time.Millisecond), thr)
		}
		return nil
	})
	if limit := time.Duration(0.2*1.1*float64(wall)) + cpuCapPeriod; used > limit {
		t.Errorf("capped at 0.2 core, the spinning process used %s of CPU in %s (limit %s)", used, wall, limit)
	}
	t.Logf("used %s of CPU in %s, throttled %s", used, wall.Round(time.Millisecond), thr.Round(time.Millisecond))
}
