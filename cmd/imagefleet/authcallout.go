package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/imagefleet/imagefleet/deploy/natsconf"
	"github.com/imagefleet/imagefleet/internal/authcallout"
)

// calloutFlags are `imagefleet bus auth-callout`'s own flags.
type calloutFlags struct {
	seedFile, audience, kubeconfig, nodeSA, account string
	roles                                           []string
	maxTTL                                          time.Duration
	concurrency                                     int
}

// config is the callout's Config from the flags, the issuer's seed read: every flag error comes before any
// connection is made.
func (f *calloutFlags) config() (authcallout.Config, error) {
	cfg := authcallout.Config{Audience: f.audience, Account: f.account, MaxTTL: f.maxTTL, Concurrency: f.concurrency}
	if f.nodeSA != "" {
		sa, err := authcallout.ParseServiceAccount(f.nodeSA)
		if err != nil {
			return cfg, fmt.Errorf("--node-service-account: %w", err)
		}
		cfg.NodeServiceAccount = sa
	}
	for _, r := range f.roles {
		rb, err := authcallout.ParseRoleBinding(r)
		if err != nil {
			return cfg, fmt.Errorf("--role: %w", err)
		}
		cfg.Roles = append(cfg.Roles, rb)
	}
	if cfg.NodeServiceAccount.IsZero() && len(cfg.Roles) == 0 {
		return cfg, fmt.Errorf("give --node-service-account or --role (or both): without them every token is refused")
	}
	if f.audience == "" {
		return cfg, fmt.Errorf("--audience must not be empty")
	}
	if f.seedFile == "" {
		return cfg, fmt.Errorf("--issuer-seed-file is required (issuer.nk of `imagefleet bus keys`)")
	}
	raw, err := os.ReadFile(f.seedFile)
	if err != nil {
		return cfg, fmt.Errorf("--issuer-seed-file: %w", err)
	}
	cfg.Issuer, err = authcallout.LoadIssuer(raw)
	clear(raw)
	if err != nil {
		return cfg, fmt.Errorf("--issuer-seed-file %s: %w", f.seedFile, err)
	}
	return cfg, nil
}

// newBusAuthCalloutCmd is `imagefleet bus auth-callout`.
func newBusAuthCalloutCmd(cl *cli) *cobra.Command {
	f := &calloutFlags{}
	cmd := &cobra.Command{
		Use:   "auth-callout --issuer-seed-file FILE --node-service-account NS/NAME [--role ROLE=NS/NAME]...",
		Short: "Let NATS clients in on Kubernetes ServiceAccount tokens (nats-server's auth callout)",
		Long: `Answer the NATS server's authorization requests (auth callout) until interrupted. A client connects with a
ServiceAccount token (--token-file); the callout asks the API server to review it (TokenReview, audience
--audience) and lets it in with the permissions of its ServiceAccount: a token of --node-service-account bound
to a pod gets the permissions of the pod's node, a token of a --role ServiceAccount those of the role (fleet,
inventory, central = fleet and inventory, admin). Any other token is refused, with the reason in this log
and the server's. A user lives until its token expires, at most --max-ttl.

The callout connects with the global flags as one of the server's auth_users (--user callout
--password-file FILE). Replicas share the requests. Its ServiceAccount needs create on tokenreviews
(authentication.k8s.io). Server config: natsconf.RenderCallout; docs/security.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			cfg, err := f.config()
			if err != nil {
				return err
			}
			defer cfg.Issuer.Wipe()
			rc, err := kubeRESTConfig(f.kubeconfig)
			if err != nil {
				return err
			}
			rc = rest.CopyConfig(rc)
			rc.QPS, rc.Burst, rc.UserAgent = authcallout.ReviewQPS, authcallout.ReviewBurst, "imagefleet-auth-callout/"+agentVersion()
			cs, err := kubernetes.NewForConfig(rc)
			if err != nil {
				return fmt.Errorf("kubernetes client: %w", err)
			}
			b, err := cl.connect(ctx, "imagefleet-auth-callout")
			if err != nil {
				return err
			}
			defer b.Close()
			svc, err := authcallout.New(cfg, cs.AuthenticationV1().TokenReviews(), b)
			if err != nil {
				return err
			}
			return svc.Run(ctx)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.seedFile, "issuer-seed-file", "", "account nkey seed signing the answers (issuer.nk of `imagefleet bus keys`)")
	fs.StringVar(&f.audience, "audience", authcallout.DefaultAudience, "audience the tokens must be issued for")
	fs.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig of the API server reviewing the tokens; empty: the pod's in-cluster config")
	fs.StringVar(&f.nodeSA, "node-service-account", "", "NAMESPACE/NAME: pod-bound tokens of this ServiceAccount get the permissions of the pod's node")
	fs.StringArrayVar(&f.roles, "role", nil, "ROLE=NAMESPACE/NAME: tokens of this ServiceAccount get ROLE's permissions (fleet, inventory, central, admin; repeatable)")
	fs.StringVar(&f.account, "account", natsconf.Account, "NATS account the users are placed in")
	fs.DurationVar(&f.maxTTL, "max-ttl", authcallout.DefaultMaxTTL, "longest life of a user: the connection is closed then (or when its token expires) and connects again")
	fs.IntVar(&f.concurrency, "concurrency", authcallout.DefaultConcurrency, "requests answered at once")
	return cmd
}

// inClusterNamespaceFile is where a pod finds its namespace.
const inClusterNamespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// newBusKeysCmd is `imagefleet bus keys`.
func newBusKeysCmd(cl *cli) *cobra.Command {
	var secret, namespace, kubeconfig string
	cmd := &cobra.Command{
		Use:   "keys --secret NAME [--namespace NS]",
		Short: "Make sure a Kubernetes Secret holds the auth callout's keys (idempotent)",
		Long: `Make sure Secret NAME holds issuer.nk (an account nkey seed: the callout signs with it), issuer.pub (its
public key: the server config's auth_callout issuer) and callout.password (the callout user's password).
A missing Secret is created; values already there are kept, so a Helm upgrade keeps the identities; a
missing key is added. RBAC: get and create on secrets (update only to add a missing key). The values are
never printed: the output names the Secret, what was done and the issuer's public key.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if secret == "" {
				return fmt.Errorf("--secret is required")
			}
			ns, err := keysNamespace(namespace, kubeconfig)
			if err != nil {
				return err
			}
			rc, err := kubeRESTConfig(kubeconfig)
			if err != nil {
				return err
			}
			cs, err := kubernetes.NewForConfig(rc)
			if err != nil {
				return fmt.Errorf("kubernetes client: %w", err)
			}
			ctx, cancel := cl.contextTimeout(cmd.Context())
			defer cancel()
			k, err := authcallout.EnsureKeys(ctx, cs.CoreV1().Secrets(ns), secret)
			if err != nil {
				return fmt.Errorf("namespace %s: %w", ns, err)
			}
			if cl.jsonOutput() {
				return printJSON(cmd.OutOrStdout(), map[string]any{"namespace": ns, "secret": secret, "action": k.Action,
					"added": k.Added, "issuer": k.IssuerPublic})
			}
			what := k.Action
			if len(k.Added) > 0 {
				what += " (added " + strings.Join(k.Added, ", ") + ")"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "secret %s/%s %s; issuer %s\n", ns, secret, what, k.IssuerPublic)
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&secret, "secret", "", "name of the Secret")
	fs.StringVar(&namespace, "namespace", "", "namespace of the Secret (default: the pod's, or the kubeconfig context's)")
	fs.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig; empty: the pod's in-cluster config")
	return cmd
}

// keysNamespace is --namespace, else the kubeconfig context's namespace, else the pod's own.
func keysNamespace(flag, kubeconfig string) (string, error) {
	if flag != "" {
		return flag, nil
	}
	if kubeconfig != "" {
		ns, _, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
			&clientcmd.ClientConfigLoadingRules{ExplicitPath: kubeconfig}, &clientcmd.ConfigOverrides{}).Namespace()
		if err != nil {
			return "", fmt.Errorf("namespace of kubeconfig %s: %w", kubeconfig, err)
		}
		return ns, nil
	}
	raw, err := os.ReadFile(inClusterNamespaceFile)
	if err != nil {
		return "", fmt.Errorf("--namespace is required outside a pod: %w", err)
	}
	return strings.TrimSpace(string(raw)), nil
}
