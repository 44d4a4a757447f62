package kubelab

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// proc is one of the lab's processes: its command line, its log file (appended to across restarts) and,
// while it runs, the process and a channel closed when it exits.
type proc struct {
	name    string
	bin     string
	args    []string
	dir     string // the lab's directory: NAME.log and NAME.pid live there
	detach  bool   // own session: the process outlives the one that started it (labctl kube-up)
	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error
}

func (p *proc) logPath() string { return filepath.Join(p.dir, p.name+".log") }
func (p *proc) pidPath() string { return filepath.Join(p.dir, p.name+".pid") }

func (p *proc) start() error {
	log, err := os.OpenFile(p.logPath(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer log.Close()
	fmt.Fprintf(log, "---- kubelab: starting %s at %s\n", p.name, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.Dir = p.dir
	// Its own process group (or session, detached): a Ctrl-C to the test or labctl does not reach it, and
	// stop signals exactly it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: !p.detach, Setsid: p.detach}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", p.name, err)
	}
	p.cmd = cmd
	p.exited = make(chan struct{})
	if err := os.WriteFile(p.pidPath(), []byte(strconv.Itoa(cmd.Process.Pid)+"\n"), 0o644); err != nil {
		return err
	}
	go func(exited chan struct{}) {
		p.waitErr = cmd.Wait()
		close(exited)
	}(p.exited)
	return nil
}

// running reports whether the process started by start has not exited.
func (p *proc) running() bool {
	if p.exited == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// stop sends SIGTERM and waits up to grace, then SIGKILL. The apiserver can take a minute to exit while a
// kubelet keeps its watches open (deploy/lab/README.md), so callers choose the grace.
func (p *proc) stop(grace time.Duration) {
	if p.exited == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.exited
	}
	_ = os.Remove(p.pidPath())
	p.exited = nil
}

// logTail returns the last n lines of the process's log.
func (p *proc) logTail(n int) string {
	b, err := os.ReadFile(p.logPath())
	if err != nil {
		return fmt.Sprintf("(no %s log: %v)", p.name, err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// stopPIDFile ends the process named in DIR/NAME.pid that a detached lab left (labctl kube-down): SIGTERM,
// then SIGKILL after grace. It checks that the pid still runs the lab's binary before signalling it.
func stopPIDFile(dir, name, bin string, grace time.Duration) error {
	b, err := os.ReadFile(filepath.Join(dir, name+".pid"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return fmt.Errorf("%s.pid: bad pid %q", name, b)
	}
	exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	if err != nil || filepath.Base(strings.TrimSuffix(exe, " (deleted)")) != bin {
		_ = os.Remove(filepath.Join(dir, name+".pid")) // gone, or the pid was reused
		return nil
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(grace)
	for time.Now().Before(deadline) && pidAlive(pid) {
		time.Sleep(50 * time.Millisecond)
	}
	if pidAlive(pid) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	return os.Remove(filepath.Join(dir, name+".pid"))
}

// pidAlive reports whether pid runs (a zombie that init has yet to reap does not count).
func pidAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z'
}
