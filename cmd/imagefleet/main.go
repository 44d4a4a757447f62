// Command imagefleet runs the node agent, the fleet workers and the operator commands.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/imagefleet/imagefleet/bus"
)

// globals are the flags every command takes.
type globals struct {
	natsURL   string
	output    string
	creds     string
	nkey      string
	tlsCA     string
	tlsCert   string
	tlsKey    string
	timeout   time.Duration
	logLevel  string
	logFormat string
}

var g globals

// commands are added by init functions of the files beside this one.
var commands []func() *cobra.Command

func registerCommand(f func() *cobra.Command) { commands = append(commands, f) }

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "imagefleet",
		Short:         "The kubelet's image lifecycle and pod index as workers over NATS",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if g.output != "" && g.output != "json" && g.output != "text" {
				return fmt.Errorf("output %q: must be text or json", g.output)
			}
			return setupLogging(cmd.ErrOrStderr())
		},
	}
	pf := root.PersistentFlags()
	pf.StringVar(&g.natsURL, "nats", "nats://127.0.0.1:4222", "NATS server URL(s), comma separated")
	pf.StringVarP(&g.output, "output", "o", "text", "output format: text or json")
	pf.StringVar(&g.creds, "creds", "", "NATS user credentials file")
	pf.StringVar(&g.nkey, "nkey", "", "NATS nkey seed file")
	pf.StringVar(&g.tlsCA, "tls-ca", "", "CA certificate for the NATS server")
	pf.StringVar(&g.tlsCert, "tls-cert", "", "client certificate for NATS")
	pf.StringVar(&g.tlsKey, "tls-key", "", "client key for NATS")
	pf.DurationVar(&g.timeout, "timeout", 30*time.Second, "how long a command waits for an answer")
	pf.StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	pf.StringVar(&g.logFormat, "log-format", "text", "log format: text or json")
	for _, f := range commands {
		root.AddCommand(f())
	}
	return root
}

func setupLogging(w io.Writer) error {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(g.logLevel)); err != nil {
		return fmt.Errorf("log level %q: %w", g.logLevel, err)
	}
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if g.logFormat == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	slog.SetDefault(slog.New(h))
	return nil
}

// busOptions are the connection options from the global flags.
func busOptions(name string) bus.Options {
	return bus.Options{Name: name, CredsFile: g.creds, NKeyFile: g.nkey, TLSCA: g.tlsCA, TLSCert: g.tlsCert,
		TLSKey: g.tlsKey, ConnectTimeout: g.timeout, Logger: slog.Default()}
}

// connect connects a client command to NATS.
func connect(ctx context.Context, name string) (*bus.Bus, error) {
	b, err := bus.Connect(ctx, g.natsURL, busOptions(name))
	if err != nil {
		return nil, err
	}
	return b, nil
}

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func jsonOutput() bool { return g.output == "json" }

// exitError carries an exit code.
type exitError struct {
	code int
	err  error
}

func (e exitError) Error() string { return e.err.Error() }
func (e exitError) Unwrap() error { return e.err }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCmd().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "imagefleet:", err)
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		os.Exit(1)
	}
}
