package lab

import (
	"context"
	"crypto/subtle"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
)

// RegistryOptions configures a loopback registry.
type RegistryOptions struct {
	// User and Password, when User is set, make every /v2/ request require HTTP basic auth with them
	// (for credential tests); a request without them gets 401 and a Basic challenge.
	User, Password string
	// Delay holds every manifest and blob read (GET or HEAD) for this long before it is served, so that
	// concurrent pulls overlap at the registry and MaxInFlight measures them. Default 0. See SetDelay.
	Delay time.Duration
}

// RegistryStats counts what a registry served since it started or since ResetStats.
type RegistryStats struct {
	// Requests is every HTTP request, pushes and rejected ones included.
	Requests int64
	// ManifestReads and BlobReads count GET and HEAD requests for manifests and blobs (the reads of a pull).
	ManifestReads, BlobReads int64
	// Unauthorized counts requests answered 401.
	Unauthorized int64
	// InFlight is the number of manifest and blob reads being served now.
	InFlight int64
	// MaxInFlight is the most manifest and blob reads served at once.
	MaxInFlight int64
	// MaxReposInFlight is the most distinct repositories with a read being served at once. With each
	// image in its own repository, it is the number of pulls that ran at once (one pull reads its config
	// and layers concurrently, so MaxInFlight alone overcounts pulls).
	MaxReposInFlight int64
}

// Registry is an OCI registry on 127.0.0.1 (go-containerregistry's in-memory registry handler in an
// http.Server), with basic auth when asked and request accounting. It stops when the test ends.
type Registry struct {
	host  string
	srv   *http.Server
	user  string
	pass  string
	delay atomic.Int64 // time.Duration

	requests, manifestReads, blobReads, unauthorized atomic.Int64
	inFlight, maxInFlight                            atomic.Int64

	mu           sync.Mutex // guards repos and maxRepos
	repos        map[string]int
	maxRepos     int64
	shutdownOnce sync.Once
}

// StartRegistry starts a registry on a free port of 127.0.0.1. containerd pulls from a loopback registry
// over plain HTTP with no registry configuration.
func StartRegistry(t testing.TB, opts RegistryOptions) *Registry {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("lab: listen for registry: %v", err)
	}
	r := &Registry{host: ln.Addr().String(), user: opts.User, pass: opts.Password, repos: map[string]int{}}
	r.delay.Store(int64(opts.Delay))
	// The handler logs every request to stderr by default; test output is no place for that.
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	r.srv = &http.Server{Handler: r.middleware(h), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := r.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("lab: registry: serve: %v", err)
		}
	}()
	t.Cleanup(r.Close)
	return r
}

// Host is host:port, the registry part of an image reference.
func (r *Registry) Host() string { return r.host }

// Ref returns the full reference of repoTag in this registry: 127.0.0.1:PORT/repoTag.
func (r *Registry) Ref(repoTag string) string { return r.host + "/" + repoTag }

// SetDelay changes the delay of manifest and blob reads (see RegistryOptions.Delay).
func (r *Registry) SetDelay(d time.Duration) { r.delay.Store(int64(d)) }

// Close stops the registry (a test of an unreachable registry may call it early); reads in progress end.
func (r *Registry) Close() {
	r.shutdownOnce.Do(func() { _ = r.srv.Close() })
}

// Stats returns the counters.
func (r *Registry) Stats() RegistryStats {
	r.mu.Lock()
	maxRepos := r.maxRepos
	r.mu.Unlock()
	return RegistryStats{
		Requests:         r.requests.Load(),
		ManifestReads:    r.manifestReads.Load(),
		BlobReads:        r.blobReads.Load(),
		Unauthorized:     r.unauthorized.Load(),
		InFlight:         r.inFlight.Load(),
		MaxInFlight:      r.maxInFlight.Load(),
		MaxReposInFlight: maxRepos,
	}
}

// ResetStats zeroes the counters (not InFlight, which counts reads still being served), for example between
// pushing the images and pulling them.
func (r *Registry) ResetStats() {
	r.requests.Store(0)
	r.manifestReads.Store(0)
	r.blobReads.Store(0)
	r.unauthorized.Store(0)
	r.maxInFlight.Store(r.inFlight.Load())
	r.mu.Lock()
	r.maxRepos = int64(len(r.repos))
	r.mu.Unlock()
}

// classify returns the repository and kind ("manifests" or "blobs") of a distribution API read, or ok false.
// Upload requests (/blobs/uploads/) are writes.
func classify(req *http.Request) (repo, kind string, ok bool) {
	if req.Method != http.MethodGet && req.Method != http.MethodHead {
		return "", "", false
	}
	p, found := strings.CutPrefix(req.URL.Path, "/v2/")
	if !found || strings.Contains(p, "/blobs/uploads") {
		return "", "", false
	}
	for _, k := range []string{"manifests", "blobs"} {
		// The repository name may hold slashes, so cut at the last /manifests/ or /blobs/.
		if i := strings.LastIndex(p, "/"+k+"/"); i > 0 {
			return p[:i], k, true
		}
	}
	return "", "", false
}

func (r *Registry) middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.requests.Add(1)
		if r.user != "" && strings.HasPrefix(req.URL.Path, "/v2") && !r.authorized(req) {
			r.unauthorized.Add(1)
			w.Header().Set("WWW-Authenticate", `Basic realm="imagefleet-lab"`)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = io.WriteString(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`)
			return
		}
		repo, kind, ok := classify(req)
		if !ok {
			next.ServeHTTP(w, req)
			return
		}
		if kind == "manifests" {
			r.manifestReads.Add(1)
		} else {
			r.blobReads.Add(1)
		}
		r.enter(repo)
		defer r.leave(repo)
		if d := time.Duration(r.delay.Load()); d > 0 {
			if err := sleepCtx(req.Context(), d); err != nil {
				return // the client went away
			}
		}
		next.ServeHTTP(w, req)
	})
}

func (r *Registry) authorized(req *http.Request) bool {
	u, p, ok := req.BasicAuth()
	return ok && subtle.ConstantTimeCompare([]byte(u), []byte(r.user)) == 1 &&
		subtle.ConstantTimeCompare([]byte(p), []byte(r.pass)) == 1
}

func (r *Registry) enter(repo string) {
	n := r.inFlight.Add(1)
	for {
		m := r.maxInFlight.Load()
		if n <= m || r.maxInFlight.CompareAndSwap(m, n) {
			break
		}
	}
	r.mu.Lock()
	r.repos[repo]++
	r.maxRepos = max(r.maxRepos, int64(len(r.repos)))
	r.mu.Unlock()
}

func (r *Registry) leave(repo string) {
	r.inFlight.Add(-1)
	r.mu.Lock()
	if r.repos[repo]--; r.repos[repo] == 0 {
		delete(r.repos, repo)
	}
	r.mu.Unlock()
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
