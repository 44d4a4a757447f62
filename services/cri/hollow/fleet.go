package hollow

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"sync"
)

// Fleet is n hollow runtimes in one process, each serving CRI on its own unix socket under one directory,
// for scale tests of a thousand nodes and more. A node costs its state, one gRPC server and one listener
// goroutine, plus a few goroutines per client connection.
type Fleet struct {
	nodes []*Runtime
	paths []string
}

// NewFleet builds n runtimes; node i gets opts(i) (opts may be nil) with the name NodeName(i, n) when
// opts leaves Name empty, and the socket <dir>/node-<i, 4 digits>.sock. Nothing listens until Serve
// or Start.
func NewFleet(dir string, n int, opts func(i int) Options) (*Fleet, error) {
	if n <= 0 {
		return nil, fmt.Errorf("new hollow fleet: %d nodes, want at least 1", n)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("new hollow fleet: %w", err)
	}
	f := &Fleet{nodes: make([]*Runtime, n), paths: make([]string, n)}
	for i := range n {
		var o Options
		if opts != nil {
			o = opts(i)
		}
		if o.Name == "" {
			o.Name = NodeName(i, n)
		}
		f.nodes[i] = New(o)
		f.paths[i] = filepath.Join(abs, fmt.Sprintf("node-%04d.sock", i))
		if len(f.paths[i]) > maxSocketPath {
			return nil, fmt.Errorf("new hollow fleet: socket path %s is longer than the %d bytes unix sockets allow", f.paths[i], maxSocketPath)
		}
	}
	return f, nil
}

// NodeName is the name of hollow node i of a fleet whose highest index is below last: hollow-<i> with i
// zero-padded to 5 digits (hollow-00000 ... hollow-99999), or to as many digits as last-1 has past that.
// The names of one fleet sort as their indexes do, and a fleet split over several processes (each
// naming its own range of indexes with the same last) names its nodes the same way.
func NodeName(i, last int) string {
	width := max(5, len(strconv.Itoa(last-1)))
	return fmt.Sprintf("hollow-%0*d", width, i)
}

// Len returns the number of nodes.
func (f *Fleet) Len() int { return len(f.nodes) }

// Node returns node i.
func (f *Fleet) Node(i int) *Runtime { return f.nodes[i] }

// Nodes returns every node, in order.
func (f *Fleet) Nodes() []*Runtime { return append([]*Runtime(nil), f.nodes...) }

// Endpoint returns node i's CRI endpoint (unix:///...), for cri.Dial.
func (f *Fleet) Endpoint(i int) string { return "unix://" + f.paths[i] }

// Endpoints returns every node's CRI endpoint, in order.
func (f *Fleet) Endpoints() []string {
	out := make([]string, len(f.paths))
	for i := range f.paths {
		out[i] = f.Endpoint(i)
	}
	return out
}

// listen opens every node's socket, or none.
func (f *Fleet) listen() ([]net.Listener, error) {
	ls := make([]net.Listener, 0, len(f.paths))
	for _, p := range f.paths {
		l, err := ListenUnix(p)
		if err != nil {
			for _, l := range ls {
				_ = l.Close() // the error to report is err
			}
			return nil, fmt.Errorf("listen hollow fleet: %w", err)
		}
		ls = append(ls, l)
	}
	return ls, nil
}

// Serve listens on every node's socket and serves them all until ctx ends; it returns once every node
// has stopped, with the errors of the nodes that failed.
func (f *Fleet) Serve(ctx context.Context) error {
	ls, err := f.listen()
	if err != nil {
		return err
	}
	errs := make([]error, len(ls))
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Go(func() { errs[i] = f.nodes[i].Serve(ctx, l) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Start listens on every node's socket, so clients can dial as soon as it returns, and serves them in the
// background until ctx ends or stop is called. stop returns once every node has stopped; it may be called
// more than once, and suits t.Cleanup.
func (f *Fleet) Start(ctx context.Context) (stop func(), err error) {
	ls, err := f.listen()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i, l := range ls {
		n := f.nodes[i]
		wg.Go(func() {
			if err := n.Serve(ctx, l); err != nil {
				n.log.Error("hollow runtime failed", "node", n.name, "err", err)
			}
		})
	}
	return func() {
		cancel()
		wg.Wait()
	}, nil
}
