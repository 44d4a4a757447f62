package bustest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/imagefleet/imagefleet/bus"
)

// Proxy stands between clients and a nats-server and loses the publishes a test chooses: a request lost on
// its way, as a loaded server drops JetStream API requests (its API queue, over its limit, drops every
// request it holds) and a server that goes away drops the pull requests it held. Everything else passes
// as it is, both ways.
type Proxy struct {
	t      testing.TB
	ln     net.Listener
	target string

	mu    sync.Mutex
	drops []*drop
	conns map[net.Conn]bool
	wg    sync.WaitGroup
}

// drop is one DropNext: match, and the subjects it dropped.
type drop struct {
	match   func(subject string) bool
	left    int
	dropped chan string
}

// NewProxy listens on a free loopback port and forwards each connection to srv; it is closed when the test
// ends.
func NewProxy(t testing.TB, srv *bus.Server) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	p := &Proxy{t: t, ln: ln, target: strings.TrimPrefix(srv.ClientURL(), "nats://"), conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// URL is the proxy's client URL.
func (p *Proxy) URL() string { return "nats://" + p.ln.Addr().String() }

// DropNext loses the next n publishes (PUB or HPUB) whose subject match accepts, from any client; the
// returned channel gets the subject of each as it is dropped.
func (p *Proxy) DropNext(n int, match func(subject string) bool) <-chan string {
	if n < 1 {
		p.t.Fatalf("proxy: DropNext(%d): want at least one publish to drop", n)
	}
	d := &drop{match: match, left: n, dropped: make(chan string, n)}
	p.mu.Lock()
	p.drops = append(p.drops, d)
	p.mu.Unlock()
	return d.dropped
}

// Close stops listening and closes every connection.
func (p *Proxy) Close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		p.conns[client], p.conns[server] = true, true
		p.mu.Unlock()
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			_, _ = io.Copy(client, server)
			_ = client.Close()
		}()
		go func() {
			defer p.wg.Done()
			_ = p.forward(server, client)
			_ = server.Close()
		}()
	}
}

// forward copies the client's protocol to the server, frame by frame, leaving out the publishes to drop.
func (p *Proxy) forward(dst io.Writer, src io.Reader) error {
	r := bufio.NewReaderSize(src, 64<<10)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return err
		}
		frame := line
		subject, size, isPub, err := pubFrame(line)
		if err != nil {
			return err
		}
		if isPub {
			payload := make([]byte, size+2) // and its CRLF
			if _, err := io.ReadFull(r, payload); err != nil {
				return err
			}
			if p.dropping(subject) {
				continue
			}
			frame = append(frame, payload...)
		}
		if _, err := dst.Write(frame); err != nil {
			return err
		}
	}
}

// dropping reports whether a publish to subject is to be lost, counting it.
func (p *Proxy) dropping(subject string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, d := range p.drops {
		if d.match(subject) {
			d.dropped <- subject
			if d.left--; d.left == 0 {
				p.drops = append(p.drops[:i], p.drops[i+1:]...)
			}
			return true
		}
	}
	return false
}

// pubFrame parses a client protocol line: for PUB <subject> [reply] <size> and HPUB <subject> [reply]
// <header size> <total size>, the subject and the size of the payload that follows.
func pubFrame(line []byte) (subject string, size int, ok bool, err error) {
	f := bytes.Fields(line)
	if len(f) == 0 {
		return "", 0, false, nil
	}
	op := string(bytes.ToUpper(f[0]))
	switch {
	case op == "PUB" && (len(f) == 3 || len(f) == 4), op == "HPUB" && (len(f) == 4 || len(f) == 5):
	case op == "PUB" || op == "HPUB":
		return "", 0, false, fmt.Errorf("proxy: malformed %s line %q", op, line)
	default:
		return "", 0, false, nil
	}
	size, err = strconv.Atoi(string(f[len(f)-1]))
	if err != nil || size < 0 {
		return "", 0, false, errors.Join(fmt.Errorf("proxy: payload size in %q", line), err)
	}
	return string(f[1]), size, true, nil
}
