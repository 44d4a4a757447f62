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

// cli is the flags every command takes; each command's constructor gets it.
type cli struct {
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
	jsDomain  string
	// pullHeartbeat is --pull-heartbeat (bus.Options.PullHeartbeat).
	pullHeartbeat time.Duration
	// tokenFile, user and passwordFile: the other identities a client can present (bus.Options).
	tokenFile    string
	user         string
	passwordFile string
}

func newRootCmd() *cobra.Command {
	cl := &cli{}
	// commands is the table of top-level commands. To add a command: write its constructor (taking the *cli
	// for the global flags) and add it here.
	commands := []func(*cli) *cobra.Command{
		newAgentCmd,
		newBusCmd,
		newDeadLettersCmd,
		newDemoCmd,
		newEventsCmd,
		newFleetCmd,
		newGCCmd,
		newHollowCmd,
		newDetectCmd,
		newRecordsCmd,
		newImagesCmd,
		newPodsCmd,
		newPullCmd,
		newRefsCmd,
	}
	root := &cobra.Command{
		Use:           "imagefleet",
		Short:         "The kubelet's image lifecycle and pod index as workers over NATS",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if cl.output != "" && cl.output != "json" && cl.output != "text" {
				return fmt.Errorf("output %q: must be text or json", cl.output)
			}
			return cl.setupLogging(cmd.ErrOrStderr())
		},
	}
	pf := root.PersistentFlags()
	pf.StringVar(&cl.natsURL, "nats", "nats://127.0.0.1:4222", "NATS server URL(s), comma separated")
	pf.StringVarP(&cl.output, "output", "o", "text", "output format: text or json")
	pf.StringVar(&cl.creds, "creds", "", "NATS user credentials file")
	pf.StringVar(&cl.nkey, "nkey", "", "NATS nkey seed file")
	pf.StringVar(&cl.tokenFile, "token-file", "", "file holding a Kubernetes ServiceAccount token for the NATS auth callout (audience imagefleet-nats), read again at each reconnect (docs/security.md)")
	pf.StringVar(&cl.user, "user", "", "NATS user name (with --password-file)")
	pf.StringVar(&cl.passwordFile, "password-file", "", "file holding the NATS password of --user, read again at each reconnect")
	pf.StringVar(&cl.tlsCA, "tls-ca", "", "CA certificate for the NATS server")
	pf.StringVar(&cl.tlsCert, "tls-cert", "", "client certificate for NATS")
	pf.StringVar(&cl.tlsKey, "tls-key", "", "client key for NATS")
	pf.StringVar(&cl.jsDomain, "js-domain", "", "JetStream domain of the fleet-wide streams and buckets when --nats is a leaf server with a domain of its own (e.g. hub): the node's pull queues and records stay in the leaf's domain (docs/operations.md)")
	pf.DurationVar(&cl.pullHeartbeat, "pull-heartbeat", bus.DefaultPullHeartbeat, "idle heartbeat of the pull consumers' requests (1s to 10s): a request the servers lost is sent again after two missed; each idle consumer costs its server one message per heartbeat (docs/scale.md)")
	pf.DurationVar(&cl.timeout, "timeout", 30*time.Second, "how long a command waits for an answer")
	pf.StringVar(&cl.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	pf.StringVar(&cl.logFormat, "log-format", "text", "log format: text or json")
	for _, f := range commands {
		root.AddCommand(f(cl))
	}
	return root
}

func (cl *cli) setupLogging(w io.Writer) error {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(cl.logLevel)); err != nil {
		return fmt.Errorf("log level %q: %w", cl.logLevel, err)
	}
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if cl.logFormat == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	slog.SetDefault(slog.New(h))
	return nil
}

// busOptions are the connection options from the global flags.
func (cl *cli) busOptions(name string) bus.Options {
	return bus.Options{Name: name, CredsFile: cl.creds, NKeyFile: cl.nkey, TokenFile: cl.tokenFile, User: cl.user,
		PasswordFile: cl.passwordFile, TLSCA: cl.tlsCA, TLSCert: cl.tlsCert, TLSKey: cl.tlsKey,
		ConnectTimeout: cl.timeout, Logger: slog.Default(), JSDomain: cl.jsDomain, PullHeartbeat: cl.pullHeartbeat}
}

// connect connects a client command to NATS.
func (cl *cli) connect(ctx context.Context, name string) (*bus.Bus, error) {
	return bus.Connect(ctx, cl.natsURL, cl.busOptions(name))
}

func (cl *cli) jsonOutput() bool { return cl.output == "json" }

// contextTimeout bounds a command's wait by --timeout.
func (cl *cli) contextTimeout(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, cl.timeout)
}

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

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
