package lab

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
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
	pid := 0
	if proc != nil {
		pid = proc.Pid
	}
	line("containerd: pid %d, running %v", pid, c.Running())
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
	_, version, err := c.client.Version(ctx)
	cancel()
	line("CRI Version: %q, error %v", version, err)
	versionErr := err
	var held []string
	bound, err := boundSockets(c.grpcSock)
	if err != nil {
		line("%v", err)
	} else {
		line("kernel sockets bound to the path (socket inode: flags, state): %v", bound)
	}
	if pid != 0 {
		held = heldSockets(pid, bound)
		line("of those, containerd (pid %d) holds: %v", pid, held)
		if s, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
			for _, l := range strings.Split(string(s), "\n") {
				if strings.HasPrefix(l, "State:") || strings.HasPrefix(l, "Threads:") {
					line("containerd %s", strings.Join(strings.Fields(l), " "))
				}
			}
		}
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		cmdline := strings.TrimSpace(strings.ReplaceAll(string(raw), "\x00", " "))
		if strings.Contains(cmdline, c.dir) {
			line("process %s: %s", strings.Split(p, "/")[2], cmdline)
		}
	}
	line("containerd log, last lines:\n%s", c.LogTail(60))
	listening, ours := 0, false
	for ino, st := range bound {
		if st != "listening" {
			continue
		}
		listening++
		ours = ours || slices.ContainsFunc(held, func(h string) bool { return strings.HasSuffix(h, " = "+ino) })
	}
	return fmt.Sprintf("containerd pid %d running %v; connect: %s; listening sockets bound to the path %d, one of them containerd's %v; CRI Version error: %v\n%s",
		pid, c.Running(), connected, listening, ours, versionErr, b.String())
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

// heldSockets returns which of the sockets (by inode) process pid has open, as "fd N = inode".
func heldSockets(pid int, sockets map[string]string) []string {
	held := []string{}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, fd := range fds {
		target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if err != nil || !strings.HasPrefix(target, "socket:[") {
			continue
		}
		ino := strings.TrimSuffix(strings.TrimPrefix(target, "socket:["), "]")
		if _, ok := sockets[ino]; ok {
			held = append(held, "fd "+fd.Name()+" = "+ino)
		}
	}
	return held
}
