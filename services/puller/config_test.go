package puller

import (
	"testing"
)

func ptr[T any](v T) *T { return &v }

func TestConfigValidate(t *testing.T) {
	for _, c := range []struct {
		name   string
		cfg    Config
		err    string
		serial bool
		tokens int
	}{
		{name: "defaults: serialized", cfg: Config{Node: "n1"}, serial: true, tokens: 1},
		{name: "max 1: serialized", cfg: Config{Node: "n1", MaxParallelImagePulls: ptr(int32(1))}, serial: true, tokens: 1},
		{name: "max 3: parallel by default", cfg: Config{Node: "n1", MaxParallelImagePulls: ptr(int32(3))}, tokens: 3},
		{name: "serialize off, no max: unlimited", cfg: Config{Node: "n1", SerializeImagePulls: ptr(false)}, tokens: 0},
		{name: "max 0", cfg: Config{Node: "n1", MaxParallelImagePulls: ptr(int32(0))},
			err: "invalid configuration: maxParallelImagePulls 0 must be a positive number"},
		{name: "max -1", cfg: Config{Node: "n1", SerializeImagePulls: ptr(false), MaxParallelImagePulls: ptr(int32(-1))},
			err: "invalid configuration: maxParallelImagePulls -1 must be a positive number"},
		{name: "serialized with max 3", cfg: Config{Node: "n1", SerializeImagePulls: ptr(true), MaxParallelImagePulls: ptr(int32(3))},
			err: "invalid configuration: maxParallelImagePulls cannot be larger than 1 unless SerializeImagePulls (--serialize-image-pulls) is set to false"},
		{name: "negative burst", cfg: Config{Node: "n1", RegistryBurst: -10},
			err: "invalid configuration: registryBurst (--registry-burst) -10 must not be a negative number"},
		{name: "negative qps", cfg: Config{Node: "n1", RegistryPullQPS: -5},
			err: "invalid configuration: registryPullQPS (--registry-qps) -5 must not be a negative number"},
		{name: "bad node", cfg: Config{Node: "Bad_Node"}, err: `node name "Bad_Node" is not a DNS-1123 subdomain (lower case alphanumerics, '-' and '.')`},
		{name: "bad policy", cfg: Config{Node: "n1", CredentialVerificationPolicy: "Sometimes"},
			err: `invalid configuration: imagePullCredentialsVerificationPolicy "Sometimes" must be one of NeverVerify, NeverVerifyPreloadedImages, NeverVerifyAllowlistedImages, AlwaysVerify`},
		{name: "allowlist without its policy", cfg: Config{Node: "n1", PreloadedImagesAllowlist: []string{"registry.k8s.io/pause"}},
			err: "invalid configuration: preloadedImagesVerificationAllowlist is only allowed with imagePullCredentialsVerificationPolicy NeverVerifyAllowlistedImages"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.cfg.Validate()
			if c.err != "" {
				if err == nil || err.Error() != c.err {
					t.Fatalf("Validate() = %v, want %q", err, c.err)
				}
				if _, nerr := New(c.cfg, nil, nil); nerr == nil || nerr.Error() != c.err {
					t.Errorf("New() = %v, want %q", nerr, c.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Validate() = %v", err)
			}
			if c.cfg.Serialized() != c.serial || c.cfg.Tokens() != c.tokens {
				t.Errorf("serialized %v tokens %d, want %v %d", c.cfg.Serialized(), c.cfg.Tokens(), c.serial, c.tokens)
			}
		})
	}
	if _, err := New(Config{Node: "n1", RegistryPullQPS: -1}, nil, nil); err == nil {
		t.Error("New accepted a negative QPS")
	}
}
