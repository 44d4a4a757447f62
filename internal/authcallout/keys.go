package authcallout

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"

	"github.com/nats-io/nkeys"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The keys of the callout's Secret (EnsureKeys).
const (
	// KeyIssuerSeed is the issuer's account nkey seed: the callout signs with it (--issuer-seed-file).
	KeyIssuerSeed = "issuer.nk"
	// KeyIssuerPub is its public key: the server config's auth_callout issuer.
	KeyIssuerPub = "issuer.pub"
	// KeyPassword is the callout user's password: the server's and the callout's (--password-file).
	KeyPassword = "callout.password"
)

// secretClient is the part of client-go's SecretInterface EnsureKeys needs.
type secretClient interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Secret, error)
	Create(ctx context.Context, s *corev1.Secret, opts metav1.CreateOptions) (*corev1.Secret, error)
	Update(ctx context.Context, s *corev1.Secret, opts metav1.UpdateOptions) (*corev1.Secret, error)
}

// Keys is what EnsureKeys found or made.
type Keys struct {
	// Action is "created" (a new Secret), "kept" (complete already, unchanged) or "completed" (keys added).
	Action string
	// Added are the keys written into an existing Secret (Action "completed").
	Added []string
	// IssuerPublic is the issuer's public key (not a secret).
	IssuerPublic string
}

// EnsureKeys makes sure Secret name holds the callout's keys: a new account nkey seed (KeyIssuerSeed), its
// public key (KeyIssuerPub) and a random password (KeyPassword). Values already there are kept, so every run
// after the first (a Helm upgrade's hook) changes nothing and the identities stay; a missing key is added
// (which needs update on the Secret, where a complete one needs only get). A seed that is not an account seed
// is an error: replacing it would change the issuer under the running servers.
func EnsureKeys(ctx context.Context, secrets secretClient, name string) (Keys, error) {
	for attempt := 0; ; attempt++ {
		k, err := ensureKeys(ctx, secrets, name)
		// Another run created or changed it meanwhile (two hook Jobs): read it again.
		if (apierrors.IsAlreadyExists(err) || apierrors.IsConflict(err)) && attempt < 3 {
			continue
		}
		return k, err
	}
}

func ensureKeys(ctx context.Context, secrets secretClient, name string) (Keys, error) {
	sec, err := secrets.Get(ctx, name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		data, pub, err := newKeys(nil)
		if err != nil {
			return Keys{}, err
		}
		_, err = secrets.Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"app.kubernetes.io/component": "nats-auth-callout"}},
			Type:       corev1.SecretTypeOpaque,
			Data:       data,
		}, metav1.CreateOptions{})
		if err != nil {
			return Keys{}, fmt.Errorf("create secret %s: %w", name, err)
		}
		return Keys{Action: "created", IssuerPublic: pub}, nil
	case err != nil:
		return Keys{}, fmt.Errorf("get secret %s: %w", name, err)
	}
	data, pub, err := newKeys(sec.Data)
	if err != nil {
		return Keys{}, fmt.Errorf("secret %s/%s: %w", sec.Namespace, name, err)
	}
	var added []string
	for k, v := range data {
		if string(sec.Data[k]) != string(v) {
			added = append(added, k)
		}
	}
	if len(added) == 0 {
		return Keys{Action: "kept", IssuerPublic: pub}, nil
	}
	slices.Sort(added)
	sec = sec.DeepCopy()
	sec.Data = data
	if _, err := secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		return Keys{}, fmt.Errorf("update secret %s: %w", name, err)
	}
	return Keys{Action: "completed", Added: added, IssuerPublic: pub}, nil
}

// newKeys is have with what is missing made: a new seed if there is none (the public key always follows the
// seed), a new password if there is none. Other keys in have are kept.
func newKeys(have map[string][]byte) (map[string][]byte, string, error) {
	data := map[string][]byte{}
	for k, v := range have {
		data[k] = v
	}
	var kp nkeys.KeyPair
	var err error
	if seed := have[KeyIssuerSeed]; len(seed) > 0 {
		kp, err = nkeys.ParseDecoratedNKey(seed)
		if err != nil {
			return nil, "", fmt.Errorf("%s is not an nkey seed: fix or delete the secret", KeyIssuerSeed)
		}
		if pub, _ := kp.PublicKey(); !nkeys.IsValidPublicAccountKey(pub) {
			return nil, "", fmt.Errorf("%s is not an account seed (SA...): fix or delete the secret", KeyIssuerSeed)
		}
	} else {
		if kp, err = nkeys.CreateAccount(); err != nil {
			return nil, "", err
		}
		seed, err := kp.Seed()
		if err != nil {
			return nil, "", err
		}
		data[KeyIssuerSeed] = append(seed, '\n')
	}
	defer kp.Wipe()
	pub, err := kp.PublicKey()
	if err != nil {
		return nil, "", err
	}
	data[KeyIssuerPub] = []byte(pub)
	if len(have[KeyPassword]) == 0 {
		raw := make([]byte, 24)
		if _, err := rand.Read(raw); err != nil {
			return nil, "", err
		}
		// A leading letter: the server reads the password from an environment variable as a config value, where
		// one starting with a digit could be taken for a number ("12e4", "64k").
		data[KeyPassword] = []byte("p" + hex.EncodeToString(raw))
	}
	return data, pub, nil
}

// LoadIssuer reads the issuer's account seed file (KeyIssuerSeed mounted).
func LoadIssuer(raw []byte) (nkeys.KeyPair, error) {
	kp, err := nkeys.ParseDecoratedNKey(raw)
	if err != nil {
		return nil, fmt.Errorf("issuer seed: %w", err)
	}
	if pub, _ := kp.PublicKey(); !nkeys.IsValidPublicAccountKey(pub) {
		kp.Wipe()
		return nil, errors.New("issuer seed: not an account seed (SA...)")
	}
	return kp, nil
}
