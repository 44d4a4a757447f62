package puller

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestMustPullChecksMetric: each must-pull check is counted in kubelet_imagemanager_image_mustpull_checks_total
// under the kubelet's result (pullmanager's MustAttemptImagePull), every result exported at 0 from the start.
func TestMustPullChecksMetric(t *testing.T) {
	secret := RecordSecret{UID: "u1", Namespace: "ns", Name: "pull", CredentialHash: "h1"}
	many := make([]RecordSecret, writeRecordWhileMatchingLimit)
	for i := range many {
		many[i] = RecordSecret{UID: fmt.Sprint("u", i+10), Namespace: "ns", Name: fmt.Sprint("s", i), CredentialHash: fmt.Sprint("x", i)}
	}
	many[0] = RecordSecret{UID: "u1", Namespace: "ns", Name: "pull", CredentialHash: "old"}
	for _, c := range []struct {
		name    string
		policy  string
		record  *PullCredentials // nil: no pulled record
		intent  bool
		creds   podCredentials
		credErr error
		must    bool
		result  string
	}{
		{"never verify", NeverVerify, nil, false, podCredentials{}, nil, false, checkCredentialPolicyAllowed},
		{"preloaded image", NeverVerifyPreloadedImages, nil, false, podCredentials{}, nil, false, checkCredentialPolicyAllowed},
		{"pulled, intent only", NeverVerifyPreloadedImages, nil, true, podCredentials{}, nil, true, checkMustAuthenticate},
		{"node pods accessible", AlwaysVerify, &PullCredentials{NodePodsAccessible: true}, false, podCredentials{}, nil, false, checkCredentialRecordFound},
		{"record without credentials", AlwaysVerify, &PullCredentials{}, false, podCredentials{}, errors.New("not asked"), true, checkMustAuthenticate},
		{"secret by hash", AlwaysVerify, &PullCredentials{KubernetesSecrets: []RecordSecret{secret}}, false,
			podCredentials{secrets: []RecordSecret{{UID: "u2", Namespace: "ns", Name: "other", CredentialHash: "h1"}}}, nil, false, checkCredentialRecordFound},
		{"secret by coordinates", AlwaysVerify, &PullCredentials{KubernetesSecrets: []RecordSecret{secret}}, false,
			podCredentials{secrets: []RecordSecret{{UID: "u1", Namespace: "ns", Name: "pull", CredentialHash: "h2"}}}, nil, false, checkCredentialRecordFound},
		{"secret by coordinates, 100 secrets recorded", AlwaysVerify, &PullCredentials{KubernetesSecrets: many}, false,
			podCredentials{secrets: []RecordSecret{{UID: "u1", Namespace: "ns", Name: "pull", CredentialHash: "new"}}}, nil, true, checkMustAuthenticate},
		{"other secret", AlwaysVerify, &PullCredentials{KubernetesSecrets: []RecordSecret{secret}}, false,
			podCredentials{secrets: []RecordSecret{{UID: "u3", Namespace: "ns", Name: "x", CredentialHash: "h3"}}}, nil, true, checkMustAuthenticate},
		{"pod credentials fail", AlwaysVerify, &PullCredentials{KubernetesSecrets: []RecordSecret{secret}}, false,
			podCredentials{}, errors.New("secret store down"), true, checkError},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := t.Context()
			checks := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "checks"}, []string{"result"})
			store := newMemRecords()
			if c.record != nil {
				if err := store.PutRecord(ctx, PulledRecord{ImageRef: "sha256:1", CredentialMapping: map[string]PullCredentials{"registry.example/app": *c.record}}); err != nil {
					t.Fatal(err)
				}
			}
			if c.intent {
				if err := store.AddIntent(ctx, "registry.example/app:1"); err != nil {
					t.Fatal(err)
				}
			}
			pm := &pullManager{store: store, policy: c.policy, now: time.Now, checks: checks}
			must := pm.mustAttemptImagePull(ctx, "registry.example/app:1", "sha256:1", func() (podCredentials, error) { return c.creds, c.credErr })
			if must != c.must {
				t.Errorf("must pull = %v, want %v", must, c.must)
			}
			if got := testutil.ToFloat64(checks.WithLabelValues(c.result)); got != 1 {
				t.Errorf("checks{result=%q} = %v, want 1", c.result, got)
			}
			if n := testutil.CollectAndCount(checks); n != 1 {
				t.Errorf("%d results counted, want 1", n)
			}
		})
	}
	reg := prometheus.NewRegistry()
	if _, err := newMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(reg, "kubelet_imagemanager_image_mustpull_checks_total"); n != 4 {
		t.Errorf("kubelet_imagemanager_image_mustpull_checks_total has %d series before any check, want 4 at 0", n)
	}
	if n := testutil.CollectAndCount(reg, "kubelet_image_manager_ensure_image_requests_total"); n != 27 {
		t.Errorf("kubelet_image_manager_ensure_image_requests_total has %d series before any request, want 27 at 0", n)
	}
}
