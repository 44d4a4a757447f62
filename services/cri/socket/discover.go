package socket

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// DefaultTimeout bounds the probe of one socket: connecting and CRI's Version. A runtime that answers at all
// answers Version in milliseconds; 2 s leaves room for a loaded node, and since Discover probes every socket
// at once, a whole discovery stays well under the 10 s an operator should wait for a failing agent to say why.
const DefaultTimeout = 2 * time.Second

// Options configures Discover and Probe.
type Options struct {
	// Root is where the host's / is mounted in the agent's filesystem: with "/host", Discover tries
	// /host/run/containerd/containerd.sock for /run/containerd/containerd.sock, so a pod can mount the host's
	// /run at /host/run. Default "": the agent's own /. Probe does not use it: an endpoint given by hand is a
	// path as the agent sees it.
	Root string
	// Timeout bounds each socket's probe (default DefaultTimeout).
	Timeout time.Duration

	// dial connects to a unix socket (default a net.Dialer). Tests replace it to meet errors that the root
	// they run as cannot: root connects to a chmod 000 socket.
	dial func(ctx context.Context, path string) (net.Conn, error)
}

// Found is a socket that answered CRI.
type Found struct {
	// Endpoint is what to give the CRI client: unix:// and the path as the agent sees it (under Root).
	Endpoint string
	// Candidate is the known place it was found at (zero when Probe checked an endpoint given by hand).
	Candidate Candidate
	// RuntimeName and RuntimeVersion are the runtime's answer to CRI Version ("containerd", "v2.1.4").
	RuntimeName, RuntimeVersion string
	// Skipped are the candidates before it that exist but did not answer (a stale socket, a containerd
	// without CRI): worth a line in the log, as the operator may have meant one of them.
	Skipped []Attempt
}

// Attempt is what happened at one candidate.
type Attempt struct {
	Candidate Candidate
	// Path is the path tried: the candidate's under Root.
	Path string
	// Err is why the socket was not used, with what to do about it. It wraps ErrNotExist, ErrNotSocket,
	// ErrPermission, ErrRefused, ErrNoAnswer or ErrNotCRI, except for a path no unix socket can have.
	Err error
}

// NotFoundError is Discover's error when no candidate answered: every path tried and what happened there.
type NotFoundError struct {
	// Root is Options.Root.
	Root string
	// Attempts holds every candidate, in the order tried.
	Attempts []Attempt
}

// Error lists one path per line: the list is the part an operator acts on, and it is read in a terminal or
// a log viewer, not parsed.
func (e *NotFoundError) Error() string {
	var b strings.Builder
	b.WriteString("no CRI socket answered")
	if e.Root != "" {
		fmt.Fprintf(&b, " under %s (where the host's directories are mounted)", e.Root)
	}
	b.WriteString("; tried:")
	none := true
	for _, a := range e.Attempts {
		fmt.Fprintf(&b, "\n  %s (%s): %v", a.Path, a.Candidate.Runtime, a.Err)
		none = none && errors.Is(a.Err, ErrNotExist)
	}
	if none {
		b.WriteString("\nno socket exists at any of them: the runtime is not running, listens elsewhere (give its endpoint)," +
			" or its directory is not mounted into the agent's pod")
	}
	return b.String()
}

// Unwrap returns every attempt's error, so errors.Is(err, ErrPermission) tells whether a socket refused the
// agent anywhere.
func (e *NotFoundError) Unwrap() []error {
	out := make([]error, 0, len(e.Attempts))
	for _, a := range e.Attempts {
		if a.Err != nil {
			out = append(out, a.Err)
		}
	}
	return out
}

// Discover returns the first of Candidates() under opts.Root that answers CRI's Version. It stats every
// candidate, then probes the sockets it found all at once, so it returns within about opts.Timeout however
// many of them hang; it waits for a candidate's probe only while no candidate before it has answered. When
// none answers the error is a *NotFoundError naming every path and what happened there.
func Discover(ctx context.Context, opts Options) (Found, error) {
	p, err := opts.prober()
	if err != nil {
		return Found{}, err
	}
	cands := Candidates()
	type state struct {
		Attempt
		info    fs.FileInfo
		sameAs  int // index of an earlier candidate that is the same file, or -1
		probing bool
		done    bool
		name    string
		version string
	}
	st := make([]state, len(cands))
	type result struct {
		i             int
		name, version string
		err           error
	}
	results := make(chan result, len(cands))
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pending := 0
	for i, c := range cands {
		s := &st[i]
		s.Candidate, s.Path, s.sameAs = c, under(opts.Root, c.Path), -1
		s.info, s.Err = check(s.Path)
		if s.Err != nil {
			s.done = true
			continue
		}
		for j := range i {
			if st[j].info != nil && os.SameFile(st[j].info, s.info) {
				s.sameAs = j
				break
			}
		}
		if s.sameAs >= 0 {
			continue
		}
		s.probing = true
		pending++
		go func(i int, path string, info fs.FileInfo) {
			name, version, err := p.probe(pctx, path, info)
			results <- result{i, name, version, err}
		}(i, s.Path, s.info)
	}
	// winner is the first candidate that answered once every candidate before it has failed; -1 while one
	// before it is still being probed, or when all failed (then settled is true).
	winner := func() (i int, settled bool) {
		for i := range st {
			s := &st[i]
			switch {
			case s.sameAs >= 0:
				// Decided by the earlier name of the same socket, which this loop has passed already.
			case !s.done:
				return -1, false
			case s.Err == nil:
				return i, true
			}
		}
		return -1, true
	}
	w, settled := winner()
	for !settled {
		r := <-results
		pending--
		s := &st[r.i]
		s.done, s.name, s.version, s.Err = true, r.name, r.version, r.err
		w, settled = winner()
	}
	// No goroutine outlives Discover: stop the probes still running and wait for them.
	cancel()
	for ; pending > 0; pending-- {
		<-results
	}
	if err := ctx.Err(); err != nil {
		return Found{}, fmt.Errorf("find CRI socket: %w", err)
	}
	for i := range st {
		if j := st[i].sameAs; j >= 0 && st[j].Err != nil {
			st[i].Err = fmt.Errorf("the same socket as %s: %w", st[j].Path, st[j].Err)
		}
	}
	if w < 0 {
		nf := &NotFoundError{Root: opts.Root}
		for _, s := range st {
			nf.Attempts = append(nf.Attempts, s.Attempt)
		}
		return Found{}, nf
	}
	f := Found{Endpoint: "unix://" + st[w].Path, Candidate: st[w].Candidate, RuntimeName: st[w].name,
		RuntimeVersion: st[w].version}
	for _, s := range st[:w] {
		if s.sameAs < 0 && !errors.Is(s.Err, ErrNotExist) {
			f.Skipped = append(f.Skipped, s.Attempt)
		}
	}
	return f, nil
}

// Probe checks an endpoint given by hand (unix:///path or a bare absolute path) the way Discover checks a
// candidate, so a wrong value fails at start with its path and cause instead of as a runtime that never
// answers. The error wraps the same sentinels.
func Probe(ctx context.Context, endpoint string, opts Options) (Found, error) {
	p, err := opts.prober()
	if err != nil {
		return Found{}, err
	}
	path := strings.TrimPrefix(endpoint, "unix://")
	if !filepath.IsAbs(path) {
		return Found{}, fmt.Errorf("CRI endpoint %q: want unix:///path/to/socket or an absolute path", endpoint)
	}
	info, err := check(path)
	if err == nil {
		var name, version string
		if name, version, err = p.probe(ctx, path, info); err == nil {
			return Found{Endpoint: "unix://" + path, RuntimeName: name, RuntimeVersion: version}, nil
		}
	}
	if ctx.Err() != nil {
		return Found{}, fmt.Errorf("check CRI socket %s: %w", path, ctx.Err())
	}
	return Found{}, fmt.Errorf("CRI socket %s: %w", path, err)
}

func (o Options) prober() (*prober, error) {
	if o.Timeout < 0 {
		return nil, fmt.Errorf("CRI socket probe timeout %v is negative", o.Timeout)
	}
	p := &prober{timeout: o.Timeout, dial: o.dial}
	if p.timeout == 0 {
		p.timeout = DefaultTimeout
	}
	if p.dial == nil {
		p.dial = func(ctx context.Context, path string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}
	}
	return p, nil
}

// under returns the host's path p as the agent sees it with the host's / at root.
func under(root, p string) string {
	if root == "" || root == "/" {
		return p
	}
	return filepath.Join(root, p)
}
