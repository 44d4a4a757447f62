package main

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"

	"github.com/imagefleet/imagefleet/services/puller"
)

// pullerFlags are the puller's agent flags (the kubelet's names where it has the setting).
var pullerFlags struct {
	fs                 *pflag.FlagSet
	serialize          bool
	maxParallel        int32
	qps                float64
	burst              int
	secretsDir         string
	nodeKeyring        string
	verificationPolicy string
	preloadedAllowlist []string
	ackWait            time.Duration
	pullOnPodAdd       bool
}

func init() {
	registerWorker(workerDef{
		Name: "puller", Default: true, NeedsCRI: true,
		Flags: func(fs *pflag.FlagSet) {
			pullerFlags.fs = fs
			fs.BoolVar(&pullerFlags.serialize, "serialize-image-pulls", true, "pull one image at a time (default true unless --max-parallel-image-pulls is 2 or more)")
			fs.Int32Var(&pullerFlags.maxParallel, "max-parallel-image-pulls", 0, "the node's pull tokens in parallel mode, enforced by the NATS server across every puller replica (unset: no limit)")
			fs.Float64Var(&pullerFlags.qps, "registry-qps", 5, "registry pulls per second (token bucket, no waiting: over it a pull fails with \"pull QPS exceeded\"); 0: unlimited")
			fs.IntVar(&pullerFlags.burst, "registry-burst", 10, "burst of the registry pull token bucket")
			fs.StringVar(&pullerFlags.secretsDir, "pull-secrets-dir", "", "directory of Secret manifests (JSON or YAML, kubernetes.io/dockerconfigjson) the pods' image pull secrets are read from, by namespace and name")
			fs.StringVar(&pullerFlags.nodeKeyring, "node-keyring", "", "docker config.json with the node's registry credentials (usable by every pod)")
			fs.StringVar(&pullerFlags.verificationPolicy, "image-pull-credentials-verification-policy", puller.NeverVerifyPreloadedImages, "KEP-2535: NeverVerify, NeverVerifyPreloadedImages, NeverVerifyAllowlistedImages or AlwaysVerify")
			fs.StringSliceVar(&pullerFlags.preloadedAllowlist, "preloaded-images-verification-allowlist", nil, "repositories (or host/path/*) never verified under NeverVerifyAllowlistedImages")
			fs.DurationVar(&pullerFlags.ackWait, "pull-ack-wait", 30*time.Second, "how long a silent puller keeps a request before another replica gets it")
			fs.BoolVar(&pullerFlags.pullOnPodAdd, "pull-on-pod-add", false, "enqueue a pull for each image of a pod added on this node (pod.added events), with the container's pull policy and the pod's pull secrets")
		},
		Build: func(_ context.Context, env *agentEnv) (runnable, error) {
			cfg := pullerConfig(env.Node)
			cfg.Logger, cfg.Registerer = env.Log, prometheus.DefaultRegisterer
			return puller.New(cfg, env.CRI, env.Bus)
		},
	})
}

// pullerConfig builds the puller's Config from the flags: an unset flag keeps the kubelet's defaulting
// (serialized unless --max-parallel-image-pulls is 2 or more).
func pullerConfig(node string) puller.Config {
	f := pullerFlags
	cfg := puller.Config{Node: node, RegistryPullQPS: f.qps, RegistryBurst: f.burst, PullSecretsDir: f.secretsDir,
		NodeKeyring: f.nodeKeyring, CredentialVerificationPolicy: f.verificationPolicy,
		PreloadedImagesAllowlist: f.preloadedAllowlist, AckWait: f.ackWait, PullOnPodAdd: f.pullOnPodAdd}
	if f.fs != nil && f.fs.Changed("serialize-image-pulls") {
		v := f.serialize
		cfg.SerializeImagePulls = &v
	}
	if f.fs != nil && f.fs.Changed("max-parallel-image-pulls") {
		v := f.maxParallel
		cfg.MaxParallelImagePulls = &v
	}
	return cfg
}
