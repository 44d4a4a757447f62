package puller

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/imagefleet/imagefleet/services/cri"
)

// SecretSource names a Kubernetes Secret a credential came from.
type SecretSource struct {
	Namespace, Name, UID string
}

// ServiceAccountSource names a service account a credential came from (credential providers).
type ServiceAccountSource struct {
	Namespace, Name, UID string
}

// Credential is one registry credential for a pull: the kubelet's TrackedAuthConfig. A node credential
// (the node keyring) has no source. Never logged: AuthConfig's String hides the secrets.
type Credential struct {
	Auth           cri.AuthConfig
	Secret         *SecretSource
	ServiceAccount *ServiceAccountSource
	// Hash identifies the credential's content (sha256 of its JSON), as the kubelet's AuthConfigHash.
	Hash string
}

func (c Credential) String() string { return c.Auth.String() }

// dockerConfigEntry is one "auths" entry of a docker config.
type dockerConfigEntry struct {
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
	Auth     string `json:"auth,omitempty"`
	Email    string `json:"email,omitempty"`
	// IdentityToken and RegistryToken are passed to the runtime as they are.
	IdentityToken string `json:"identitytoken,omitempty"`
	RegistryToken string `json:"registrytoken,omitempty"`
}

// parseDockerConfig reads a .dockerconfigjson ({"auths": {...}}) or a legacy .dockercfg ({registry: entry}).
func parseDockerConfig(data []byte) (map[string]dockerConfigEntry, error) {
	var wrapped struct {
		Auths map[string]dockerConfigEntry `json:"auths"`
	}
	if err := json.Unmarshal(data, &wrapped); err == nil && wrapped.Auths != nil {
		return wrapped.Auths, nil
	}
	var legacy map[string]dockerConfigEntry
	if err := json.Unmarshal(data, &legacy); err != nil {
		return nil, fmt.Errorf("docker config is neither {\"auths\": {...}} nor a .dockercfg map")
	}
	return legacy, nil
}

// decodeAuthField splits base64(username:password), padded or not (the kubelet's decodeDockerConfigFieldAuth).
func decodeAuthField(field string) (user, pass string, err error) {
	var decoded []byte
	if strings.HasSuffix(strings.TrimSpace(field), "=") {
		decoded, err = base64.StdEncoding.DecodeString(field)
	} else {
		decoded, err = base64.RawStdEncoding.DecodeString(field)
	}
	if err != nil {
		return "", "", fmt.Errorf("auth field is not base64")
	}
	u, p, ok := strings.Cut(string(decoded), ":")
	if !ok {
		return "", "", fmt.Errorf("unable to parse auth field, must be formatted as base64(username:password)")
	}
	return u, p, nil
}

// keyring is the kubelet's BasicDockerKeyring: credentials indexed by registry location, looked up by the
// normalized repository (docker.io/library/busybox) with host globs, port and path-prefix matching, the
// most specific location first.
type keyring struct {
	index []string
	creds map[string][]Credential
}

func (k *keyring) add(cfg map[string]dockerConfigEntry, secret *SecretSource) error {
	if k.creds == nil {
		k.creds = map[string][]Credential{}
	}
	locs := make([]string, 0, len(cfg))
	for loc := range cfg {
		locs = append(locs, loc)
	}
	sort.Strings(locs)
	for _, loc := range locs {
		ent := cfg[loc]
		user, pass := ent.Username, ent.Password
		if ent.Auth != "" {
			var err error
			if user, pass, err = decodeAuthField(ent.Auth); err != nil {
				return fmt.Errorf("registry %q: %w", loc, err)
			}
		}
		value := loc
		if !strings.HasPrefix(value, "https://") && !strings.HasPrefix(value, "http://") {
			value = "https://" + value
		}
		parsed, err := url.Parse(value)
		if err != nil {
			continue // the kubelet ignores an entry it cannot parse
		}
		path := parsed.Path
		if strings.HasPrefix(path, "/v2/") || strings.HasPrefix(path, "/v1/") {
			path = path[3:]
		}
		key := parsed.Host
		if path != "" && path != "/" {
			key += path
		}
		// No ServerAddress, as the kubelet's keyring: containerd would parse "host:port" as a URL and fail.
		auth := cri.AuthConfig{Username: user, Password: pass,
			IdentityToken: ent.IdentityToken, RegistryToken: ent.RegistryToken}
		raw, _ := json.Marshal(struct{ U, P, I, R string }{user, pass, ent.IdentityToken, ent.RegistryToken})
		sum := sha256.Sum256(raw)
		var src *SecretSource
		if secret != nil {
			s := *secret
			src = &s
		}
		if _, ok := k.creds[key]; !ok {
			k.index = append(k.index, key)
		}
		k.creds[key] = append(k.creds[key], Credential{Auth: auth, Secret: src, Hash: hex.EncodeToString(sum[:])})
	}
	sort.Sort(sort.Reverse(sort.StringSlice(k.index)))
	return nil
}

const defaultRegistryHost = "index.docker.io"

// lookup returns the credentials for repo (a normalized repository name such as docker.io/library/busybox).
func (k *keyring) lookup(repo string) []Credential {
	if k == nil {
		return nil
	}
	var out []Credential
	for _, loc := range k.index {
		if urlsMatch(loc, repo) {
			out = append(out, k.creds[loc]...)
		}
	}
	if len(out) > 0 {
		return out
	}
	if isDefaultRegistryMatch(repo) {
		return append(out, k.creds[defaultRegistryHost]...)
	}
	return nil
}

func isDefaultRegistryMatch(image string) bool {
	parts := strings.SplitN(image, "/", 2)
	if parts[0] == "" {
		return false
	}
	if len(parts) == 1 || parts[0] == "docker.io" || parts[0] == "index.docker.io" {
		return true
	}
	return !strings.ContainsAny(parts[0], ".:")
}

func splitSchemeless(s string) (hostParts []string, port, path string, ok bool) {
	u, err := url.Parse("https://" + s)
	if err != nil {
		return nil, "", "", false
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil {
		host, port = u.Host, ""
	}
	return strings.Split(host, "."), port, u.Path, true
}

// urlsMatch is the kubelet's URLsMatchStr: same port, same number of host labels each matching the glob's
// label (filepath.Match), and the glob's path a prefix of the target's.
func urlsMatch(glob, target string) bool {
	gParts, gPort, gPath, ok1 := splitSchemeless(glob)
	tParts, tPort, tPath, ok2 := splitSchemeless(target)
	if !ok1 || !ok2 || gPort != tPort || len(gParts) != len(tParts) || !strings.HasPrefix(tPath, gPath) {
		return false
	}
	for i, g := range gParts {
		if m, err := filepath.Match(g, tParts[i]); err != nil || !m {
			return false
		}
	}
	return true
}

// loadNodeKeyring reads a docker config.json (the node's credentials, usable by every pod).
func loadNodeKeyring(path string) (*keyring, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read node keyring: %w", err)
	}
	cfg, err := parseDockerConfig(data)
	if err != nil {
		return nil, fmt.Errorf("node keyring %s: %w", path, err)
	}
	k := &keyring{}
	if err := k.add(cfg, nil); err != nil {
		return nil, fmt.Errorf("node keyring %s: %w", path, err)
	}
	return k, nil
}

// secretsDir serves pull secrets from a directory of Secret manifests (JSON or YAML, one Secret per file,
// type kubernetes.io/dockerconfigjson or kubernetes.io/dockercfg), found by namespace and name. The
// directory is read again when it changes (level-based: a secret written after the puller started is seen).
type secretsDir struct {
	dir string

	mu      sync.Mutex
	stamp   string
	secrets map[string]corev1.Secret // namespace/name
	errs    map[string]error         // file -> why it was skipped
}

func (d *secretsDir) get(namespace, name string) (corev1.Secret, bool, error) {
	if d == nil || d.dir == "" {
		return corev1.Secret{}, false, nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.refreshLocked(); err != nil {
		return corev1.Secret{}, false, err
	}
	s, ok := d.secrets[namespace+"/"+name]
	return s, ok, nil
}

func (d *secretsDir) refreshLocked() error {
	entries, err := os.ReadDir(d.dir)
	if err != nil {
		return fmt.Errorf("read pull secrets dir: %w", err)
	}
	var sb strings.Builder
	for _, e := range entries {
		if info, err := e.Info(); err == nil {
			fmt.Fprintf(&sb, "%s:%d:%d;", e.Name(), info.Size(), info.ModTime().UnixNano())
		}
	}
	if sb.String() == d.stamp && d.secrets != nil {
		return nil
	}
	secrets := map[string]corev1.Secret{}
	errs := map[string]error{}
	for _, e := range entries {
		n := e.Name()
		if e.IsDir() || strings.HasPrefix(n, ".") {
			continue
		}
		ext := strings.ToLower(filepath.Ext(n))
		if ext != ".json" && ext != ".yaml" && ext != ".yml" {
			continue
		}
		data, err := os.ReadFile(filepath.Join(d.dir, n))
		if err != nil {
			errs[n] = err
			continue
		}
		var s corev1.Secret
		if err := yaml.Unmarshal(data, &s); err != nil {
			errs[n] = fmt.Errorf("not a Secret manifest")
			continue
		}
		if s.Name == "" {
			errs[n] = fmt.Errorf("secret has no name")
			continue
		}
		if s.Namespace == "" {
			s.Namespace = "default"
		}
		// stringData is an input-only field; honour it for hand-written manifests.
		for k, v := range s.StringData {
			if s.Data == nil {
				s.Data = map[string][]byte{}
			}
			s.Data[k] = []byte(v)
		}
		secrets[s.Namespace+"/"+s.Name] = s
	}
	d.stamp, d.secrets, d.errs = sb.String(), secrets, errs
	return nil
}

// secretKeyring builds the keyring of a pod's pull secrets (the kubelet's MakeDockerKeyring input), in the
// order the pod names them. As the kubelet's secretsToTrackedDockerConfigs, a secret is used only when it has
// the docker-config type and that type's key, non-empty: kubernetes.io/dockerconfigjson with
// .dockerconfigjson, or kubernetes.io/dockercfg with .dockercfg. Any other secret (an Opaque secret holding a
// .dockerconfigjson key, a typed secret without its key) is skipped, as the kubelet skips it.
func secretKeyring(secrets []corev1.Secret) (*keyring, error) {
	k := &keyring{}
	for _, s := range secrets {
		var data []byte
		switch {
		case s.Type == corev1.SecretTypeDockerConfigJson && len(s.Data[corev1.DockerConfigJsonKey]) > 0:
			data = s.Data[corev1.DockerConfigJsonKey]
		case s.Type == corev1.SecretTypeDockercfg && len(s.Data[corev1.DockerConfigKey]) > 0:
			data = s.Data[corev1.DockerConfigKey]
		default:
			continue
		}
		cfg, err := parseDockerConfig(data)
		if err != nil {
			return nil, fmt.Errorf("pull secret %s/%s: %w", s.Namespace, s.Name, err)
		}
		src := &SecretSource{Namespace: s.Namespace, Name: s.Name, UID: string(s.UID)}
		if err := k.add(cfg, src); err != nil {
			return nil, fmt.Errorf("pull secret %s/%s: %w", s.Namespace, s.Name, err)
		}
	}
	return k, nil
}
