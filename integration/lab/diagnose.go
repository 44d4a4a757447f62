package lab

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Diagnose reports what stands behind the CRI socket right now, for a test that finds the runtime
// unreachable: the process the lab started and whether it lives, when the socket file was made, whether a
// plain connect and a CRI Version succeed, which listening unix sockets the kernel has bound to the path, which of
// them containerd holds, every process whose command line points into the lab's directory, and the end of
// containerd's log. The first line sums it up (a test's failure line can carry it); each other line stands
// alone, so a part that cannot be read leaves the others.
func (c *Containerd) Diagnose() string {
	var b strings.Builder
	line := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	c.mu.Lock()
	proc := c.proc
	c.mu.Unlock()
	running := c.Running()
	pid := 0
	if proc != nil {
		pid = proc.Pid
	}
	line("containerd: pid %d, running %v", pid, running)
	if fi, err := os.Lstat(c.grpcSock); err != nil {
		line("socket %s: %v", c.grpcSock, err)
	} else {
		line("socket %s: mode %s, modified %s", c.grpcSock, fi.Mode(), fi.ModTime().Format(time.RFC3339Nano))
	}
	connected := "ok"
	if conn, err := net.DialTimeout("unix", c.grpcSock, 2*time.Second); err != nil {
		connected = err.Error()
	} else {
		conn.Close()
	}
	line("connect: %s", connected)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	_, version, versionErr := c.client.Version(ctx)
	cancel()
	line("CRI Version: %q, error %v", version, versionErr)
	bound, err := boundSockets(c.grpcSock)
	if err != nil {
		line("%v", err)
	} else {
		line("kernel sockets bound to the path (socket inode: flags, state): %v", bound)
	}
	// A dead process's pid may belong to another process by now: only a running containerd's is read.
	var held map[string]string
	if running {
		held = heldSockets(pid, bound)
		line("of those, containerd (pid %d) holds (socket inode: fd): %v", pid, held)
		if s, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
			for _, l := range strings.Split(string(s), "\n") {
				if strings.HasPrefix(l, "State:") || strings.HasPrefix(l, "Threads:") {
					line("containerd %s", strings.Join(strings.Fields(l), " "))
				}
			}
		}
	}
	procs, err := ProcessesMentioning(c.dir + "/")
	if err != nil {
		line("%v", err)
	}
	for _, p := range procs {
		line("process %s", p)
	}
	line("containerd log, last lines:\n%s", c.LogTail(60))
	listening, ours := 0, false
	for ino, st := range bound {
		if st == "listening" {
			listening++
			_, mine := held[ino]
			ours = ours || mine
		}
	}
	return fmt.Sprintf("containerd pid %d running %v; connect: %s; listening sockets bound to the path %d, one of them containerd's %v; CRI Version error: %v\n%s",
		pid, running, connected, listening, ours, versionErr, b.String())
}

// ProcessesMentioning lists the live processes whose command line contains s, as "pid: command line" (a
// zombie holds nothing and is left out).
func ProcessesMentioning(s string) ([]string, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	var out []string
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil || !strings.Contains(string(cmdline), s) {
			continue
		}
		if stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat")); err == nil && strings.Contains(string(stat), ") Z ") {
			continue
		}
		out = append(out, e.Name()+": "+strings.TrimSpace(strings.ReplaceAll(string(cmdline), "\x00", " ")))
	}
	return out, nil
}

// boundSockets lists the unix sockets bound to path (socket inode to "listening" or "flags F state S") from
// /proc/net/unix, whose lines are: Num RefCount Protocol Flags Type St Inode Path. Flag 0x10000 is
// __SO_ACCEPTCON, a socket that listen() was called on.
func boundSockets(path string) (map[string]string, error) {
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return nil, fmt.Errorf("read the kernel's unix sockets: %w", err)
	}
	defer f.Close()
	bound := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) != 8 || fs[7] != path {
			continue
		}
		flags, err := strconv.ParseUint(fs[3], 16, 32)
		if err == nil && flags&0x10000 != 0 {
			bound[fs[6]] = "listening"
		} else {
			bound[fs[6]] = "flags " + fs[3] + " state " + fs[5]
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read the kernel's unix sockets: %w", err)
	}
	return bound, nil
}

// heldSockets returns which of the sockets (by inode) process pid has open, as socket inode to "fd N".
func heldSockets(pid int, sockets map[string]string) map[string]string {
	held := map[string]string{}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, fd := range fds {
		target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err != nil || !strings.HasPrefix(target, "socket:[") {
			continue
		}
		ino := strings.TrimSuffix(strings.TrimPrefix(target, "socket:["), "]")
		if _, ok := sockets[ino]; ok {
			held[ino] = "fd " + fd.Name()
		}
	}
	return held
}
