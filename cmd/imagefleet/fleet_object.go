package main

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"

	"github.com/spf13/cobra"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/imagefleet/imagefleet/api/v1alpha1"
	"github.com/imagefleet/imagefleet/services/fleet/controller"
)

// objectFlags are fleet gc's and fleet pull's way to hand the rollout to the cluster's controller: the
// command creates an ImageGC or ImagePrePull through the API server, with no NATS credentials, and the
// central Deployment runs it (docs/kubernetes-objects.md).
type objectFlags struct {
	name       string
	kubeconfig string
}

func (o *objectFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringVar(&o.name, "object", "", "create an ImageGC or ImagePrePull of this name through the Kubernetes API server instead of running the rollout here: the cluster's controller runs it (kubectl wait --for=condition=Complete); needs no NATS credentials")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig of --object (empty: $KUBECONFIG, ~/.kube/config, or the pod's in-cluster config)")
}

// spec turns the rollout flags into the objects' common spec; the flags that only a rollout run here has
// are refused.
func (f *rolloutFlags) spec(cmd *cobra.Command) (v1alpha1.RolloutSpec, error) {
	for _, name := range []string{"id", "stream-replicas", "mem-profile"} {
		if cmd.Flags().Changed(name) {
			return v1alpha1.RolloutSpec{}, fmt.Errorf("--%s and --object exclude each other: the controller names the rollout after the object", name)
		}
	}
	var s v1alpha1.RolloutSpec
	if f.selector != "" && f.nodes != "" {
		return s, errors.New("--selector and --nodes exclude each other")
	}
	if f.selector != "" {
		sel, err := metav1.ParseToLabelSelector(f.selector)
		if err != nil {
			return s, fmt.Errorf("--selector: %w", err)
		}
		s.Nodes.Selector = sel
	}
	for _, n := range strings.Split(f.nodes, ",") {
		if n = strings.TrimSpace(n); n != "" {
			s.Nodes.Names = append(s.Nodes.Names, n)
		}
	}
	s.Nodes.IncludeLost = f.includeLost
	s.Waves = v1alpha1.Waves{InitialBatch: int32(f.initialBatch), MaxInFlight: int32(f.maxInFlight)}
	s.FailureBudget = intstr.Parse(f.maxFailures)
	s.NodeTimeout = &metav1.Duration{Duration: f.nodeTimeout}
	return s, nil
}

// createObject creates obj through the API server of o.kubeconfig and says how to follow it.
func (cl *cli) createObject(cmd *cobra.Command, o objectFlags, obj client.Object) error {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = o.kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	scheme, err := controller.Scheme()
	if err != nil {
		return err
	}
	controller.UseLogger(slog.Default())
	c, err := client.New(rc, client.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("kubernetes client: %w", err)
	}
	obj.SetName(o.name)
	ctx, cancel := cl.contextTimeout(cmd.Context())
	defer cancel()
	if err := c.Create(ctx, obj); err != nil {
		return fmt.Errorf("create %s: %w", o.name, err)
	}
	resource := "imagegc"
	if _, ok := obj.(*v1alpha1.ImagePrePull); ok {
		resource = "imageprepull"
	}
	if cl.jsonOutput() {
		return printJSON(cmd.OutOrStdout(), obj)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "%s.imagefleet.io/%s created\n", resource, obj.GetName())
	fmt.Fprintf(cmd.ErrOrStderr(), "follow it: kubectl get %s %s -w; kubectl wait --for=condition=Complete %s/%s\n",
		resource, obj.GetName(), resource, obj.GetName())
	return nil
}
