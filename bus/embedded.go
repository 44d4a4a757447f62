package bus

import (
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// ServerConfig configures an embedded nats-server.
type ServerConfig struct {
	// Listen is host:port of the client listener (default 127.0.0.1:4222; port -1 picks a free port).
	Listen string
	// StoreDir is the JetStream file store directory (required unless ConfigFile sets it).
	StoreDir string
	// ConfigFile is a nats-server configuration file (clusters, accounts, TLS, leaf nodes). When set it is
	// the base configuration; Listen and StoreDir override it only when non-empty.
	ConfigFile string
	// ServerName names the server (default: imagefleet-<port>).
	ServerName string
	// MaxPayload caps message size (default 1 MiB, the nats-server default).
	MaxPayload int32
}

// Server is a running embedded nats-server.
type Server struct{ s *server.Server }

// StartServer starts an embedded nats-server with JetStream and waits until it accepts connections.
func StartServer(cfg ServerConfig) (*Server, error) {
	opts := &server.Options{}
	if cfg.ConfigFile != "" {
		o, err := server.ProcessConfigFile(cfg.ConfigFile)
		if err != nil {
			return nil, fmt.Errorf("read nats config %s: %w", cfg.ConfigFile, err)
		}
		opts = o
	} else {
		opts.Host, opts.Port = "127.0.0.1", 4222
	}
	if cfg.Listen != "" {
		host, portStr, err := net.SplitHostPort(cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("parse listen address %q: %w", cfg.Listen, err)
		}
		port, err := strconv.Atoi(portStr)
		if err != nil {
			return nil, fmt.Errorf("parse listen port %q: %w", portStr, err)
		}
		opts.Host, opts.Port = host, port
	}
	opts.JetStream = true
	if cfg.StoreDir != "" {
		opts.StoreDir = cfg.StoreDir
	}
	if opts.StoreDir == "" {
		return nil, fmt.Errorf("embedded nats-server needs a JetStream store directory")
	}
	if cfg.ServerName != "" {
		opts.ServerName = cfg.ServerName
	}
	if cfg.MaxPayload > 0 {
		opts.MaxPayload = cfg.MaxPayload
	}
	opts.NoSigs = true
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("create nats-server: %w", err)
	}
	fatal := new(atomic.Pointer[string])
	if opts.LogFile != "" || opts.Syslog || opts.RemoteSyslog != "" {
		s.ConfigureLogger() // the configuration file asks for nats-server's own log
	} else {
		s.SetLoggerV2(serverLog{l: slog.Default(), fatal: fatal}, opts.Debug, opts.Trace, false)
	}
	s.Start()
	// A fatal error (a port in use) does not stop nats-server's start: it would wait out the 30 s.
	for deadline := time.Now().Add(30 * time.Second); !s.ReadyForConnections(100 * time.Millisecond); {
		if msg := fatal.Load(); msg != nil {
			s.Shutdown()
			return nil, fmt.Errorf("nats-server on %s:%d: %s", opts.Host, opts.Port, *msg)
		}
		if time.Now().After(deadline) {
			s.Shutdown()
			return nil, fmt.Errorf("nats-server on %s:%d not ready after 30s", opts.Host, opts.Port)
		}
	}
	return &Server{s: s}, nil
}

// ClientURL is the URL clients connect to.
func (s *Server) ClientURL() string { return s.s.ClientURL() }

// Shutdown stops the server and waits for it to finish.
func (s *Server) Shutdown() {
	s.s.Shutdown()
	s.s.WaitForShutdown()
}

// serverLog sends nats-server's errors and warnings to slog (a port already in use, a route that cannot be
// reached, a store that cannot be written); its notices go to debug, so a healthy server is quiet.
type serverLog struct {
	l     *slog.Logger
	fatal *atomic.Pointer[string] // the first fatal error, which ends StartServer's wait
}

func (s serverLog) Noticef(format string, v ...any) {
	s.l.Debug("nats-server: " + fmt.Sprintf(format, v...))
}
func (s serverLog) Warnf(format string, v ...any) {
	s.l.Warn("nats-server: " + fmt.Sprintf(format, v...))
}
func (s serverLog) Errorf(format string, v ...any) {
	s.l.Error("nats-server: " + fmt.Sprintf(format, v...))
}
func (s serverLog) Fatalf(format string, v ...any) {
	msg := fmt.Sprintf(format, v...)
	s.fatal.CompareAndSwap(nil, &msg)
	s.l.Error("nats-server: " + msg)
}
func (s serverLog) Debugf(format string, v ...any) {
	s.l.Debug("nats-server: " + fmt.Sprintf(format, v...))
}
func (s serverLog) Tracef(format string, v ...any) {
	s.l.Debug("nats-server: " + fmt.Sprintf(format, v...))
}

// NumLeafNodes is the number of leaf node connections the server has (a hub's leaf servers, or a leaf's
// connection to its hub).
func (s *Server) NumLeafNodes() int { return s.s.NumLeafNodes() }

// LeafTraffic is what crossed the server's leaf node connections since they were made, summed over them:
// messages and bytes in (from the leaves) and out (to them).
type LeafTraffic struct {
	InMsgs, OutMsgs, InBytes, OutBytes int64
}

// LeafTraffic sums the traffic of the server's leaf node connections.
func (s *Server) LeafTraffic() (LeafTraffic, error) {
	z, err := s.s.Leafz(nil)
	if err != nil {
		return LeafTraffic{}, fmt.Errorf("leafz: %w", err)
	}
	var t LeafTraffic
	for _, l := range z.Leafs {
		t.InMsgs += l.InMsgs
		t.OutMsgs += l.OutMsgs
		t.InBytes += l.InBytes
		t.OutBytes += l.OutBytes
	}
	return t, nil
}

// MsgCounts are the messages the server received from and sent to all its connections (clients, routes,
// leaf nodes) since it started.
func (s *Server) MsgCounts() (in, out int64, err error) {
	v, err := s.s.Varz(nil)
	if err != nil {
		return 0, 0, fmt.Errorf("varz: %w", err)
	}
	return v.InMsgs, v.OutMsgs, nil
}
