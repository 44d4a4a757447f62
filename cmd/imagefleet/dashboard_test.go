package main_test

import (
	"encoding/json"
	"fmt"
	"github.com/imagefleet/imagefleet/bus/bustest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/imagefleet/imagefleet/services/cri"
	"github.com/imagefleet/imagefleet/services/cri/hollow"
)

// dashboardFile is the Grafana dashboard over the GC and pull metrics.
const dashboardFile = "../../deploy/grafana/imagefleet.json"

// TestDashboardQueriesUseExportedMetrics checks every PromQL expression of the Grafana dashboard (each
// panel target, and the metric of each label_values variable) against a real scrape of a running agent's
// /metrics: the agent with the GC (a byte quota), puller and pod index workers on a hollow CRI runtime, after a GC pass
// and a pull (some series appear with their first pass). Each expression must parse (balanced brackets,
// closed strings and label matchers) and select at least one metric, and every metric it selects must be in
// the scrape.
func TestDashboardQueriesUseExportedMetrics(t *testing.T) {
	exprs, err := dashboardExprs(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if len(exprs) < 10 {
		t.Fatalf("%d expressions in %s: the dashboard is not read", len(exprs), dashboardFile)
	}

	rt := hollow.New(hollow.Options{Name: "dashboard"})
	if _, err := rt.AddImage(cri.Image{RepoTags: []string{"docker.io/library/redis:7"}, Size: 200}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	endpoint, stop, err := rt.StartUnix(t.Context(), filepath.Join(dir, "cri.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	port := freePort(t)
	nats := fmt.Sprintf("nats://127.0.0.1:%d", port)
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	const node = "node-dash"
	startAgent(t, "--node", node, "--cri", endpoint, "--embedded-nats", fmt.Sprintf("127.0.0.1:%d", port),
		"--data-dir", filepath.Join(dir, "data"), "--workers", "detector,cache,gc,puller,podindex,metrics",
		"--image-fs-capacity", "1000000",
		"--metrics-addr", metricsAddr)
	bustest.Eventually(t, "gc pass", pollTimeout, func() error {
		if out, errOut, code := run(t, "gc", "--node", node, "--nats", nats, "--timeout", "5s"); code != 0 {
			return fmt.Errorf("exit %d: %s %s", code, out, errOut)
		}
		return nil
	})
	bustest.Eventually(t, "pull", pollTimeout, func() error {
		if out, errOut, code := run(t, "pull", "--node", node, "--nats", nats, "--wait", "docker.io/library/busybox:1.36"); code != 0 {
			return fmt.Errorf("exit %d: %s %s", code, out, errOut)
		}
		return nil
	})
	var exported map[string]bool
	bustest.Eventually(t, "scrape", pollTimeout, func() error {
		body, status, err := httpGet(t, "http://"+metricsAddr+"/metrics")
		if err != nil || status != 200 {
			return fmt.Errorf("GET /metrics: %d %v", status, err)
		}
		exported = scrapedNames(body)
		if !exported["kubelet_image_pull_duration_seconds_count"] {
			return fmt.Errorf("no pull observed in the scrape yet")
		}
		return nil
	})

	var missing []string
	for _, e := range exprs {
		names, err := promqlMetricNames(e)
		if err != nil {
			t.Errorf("expression %q: %v", e, err)
			continue
		}
		if len(names) == 0 {
			t.Errorf("expression %q selects no metric", e)
		}
		for _, n := range names {
			if !exported[n] && !slices.Contains(missing, n) {
				missing = append(missing, n)
				t.Errorf("metric %s (in %q) is not exported by the agent", n, e)
			}
		}
	}
}

// dashboardExprs returns the expressions of a Grafana dashboard: every target's expr (panels nested in rows
// included) and, for each query variable, the selector of its label_values(...).
func dashboardExprs(path string) ([]string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d struct {
		Panels     []json.RawMessage `json:"panels"`
		Templating struct {
			List []struct {
				Type  string `json:"type"`
				Query any    `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	type panel struct {
		Panels  []json.RawMessage `json:"panels"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	}
	var out []string
	var walk func([]json.RawMessage) error
	walk = func(ps []json.RawMessage) error {
		for _, r := range ps {
			var p panel
			if err := json.Unmarshal(r, &p); err != nil {
				return err
			}
			for _, tg := range p.Targets {
				if tg.Expr == "" {
					return fmt.Errorf("a target of %s has no expr", path)
				}
				out = append(out, tg.Expr)
			}
			if err := walk(p.Panels); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(d.Panels); err != nil {
		return nil, err
	}
	for _, v := range d.Templating.List {
		q, _ := v.Query.(string)
		if v.Type != "query" {
			continue
		}
		sel, ok := strings.CutPrefix(q, "label_values(")
		i := strings.LastIndex(sel, ",")
		if !ok || i < 0 {
			return nil, fmt.Errorf("variable query %q is not label_values(selector, label)", q)
		}
		out = append(out, sel[:i])
	}
	return out, nil
}

// scrapedNames returns the names of the series in a Prometheus text exposition, and for each histogram and
// summary its _bucket, _sum and _count.
func scrapedNames(body string) map[string]bool {
	names := map[string]bool{}
	for _, line := range strings.Split(body, "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" && (f[3] == "histogram" || f[3] == "summary") {
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				names[f[2]+suffix] = true
			}
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			names[line[:i]] = true
		}
	}
	return names
}

// promqlNonMetrics are PromQL words that are never metric names: aggregation operators, keywords, and
// functions (a function is also recognised by its "(").
var promqlNonMetrics = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
	"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true,
	"limit_ratio": true, "and": true, "or": true, "unless": true, "bool": true, "offset": true, "atan2": true,
	"inf": true, "nan": true,
}

// promqlLabelLists are the keywords followed by a parenthesised list of label names.
var promqlLabelLists = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true}

// promqlMetricNames returns the metric names a PromQL expression selects, by a small lexer (the PromQL parser
// would bring the Prometheus server's dependencies into the main module): string literals, label matchers
// {...}, ranges [...] and Grafana variables ($x, ${x}) are skipped; an identifier followed by "(" is a
// function; the lists after by, without, on, ignoring, group_left and group_right are label names. It
// fails on unbalanced brackets and unterminated strings.
func promqlMetricNames(expr string) ([]string, error) {
	var names []string
	var depth []byte
	isIdentStart := func(c byte) bool { return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }
	isIdent := func(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }
	skipSpace := func(i int) int {
		for i < len(expr) && strings.IndexByte(" \t\n\r", expr[i]) >= 0 {
			i++
		}
		return i
	}
	// skipTo returns the index after the bracket closing the one at i, strings inside included.
	skipTo := func(i int, open, close byte) (int, error) {
		n := 0
		for j := i; j < len(expr); j++ {
			switch c := expr[j]; c {
			case '"', '\'', '`':
				k := j + 1
				for k < len(expr) && expr[k] != c {
					if expr[k] == '\\' && c != '`' {
						k++
					}
					k++
				}
				if k >= len(expr) {
					return 0, fmt.Errorf("unterminated string at %d", j)
				}
				j = k
			case open:
				n++
			case close:
				n--
				if n == 0 {
					return j + 1, nil
				}
			}
		}
		return 0, fmt.Errorf("unclosed %q at %d", open, i)
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case strings.IndexByte(" \t\n\r,+-*/%^=!<>", c) >= 0:
			i++
		case c >= '0' && c <= '9', c == '.':
			// A number or a duration (5m, 1h30m, 0x1f, 1e3).
			for i < len(expr) && (isIdent(expr[i]) || expr[i] == '.') {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			k := i + 1
			for k < len(expr) && expr[k] != c {
				if expr[k] == '\\' && c != '`' {
					k++
				}
				k++
			}
			if k >= len(expr) {
				return nil, fmt.Errorf("unterminated string at %d", i)
			}
			i = k + 1
		case c == '{':
			end, err := skipTo(i, '{', '}')
			if err != nil {
				return nil, err
			}
			i = end
		case c == '[':
			end, err := skipTo(i, '[', ']')
			if err != nil {
				return nil, err
			}
			i = end
		case c == '$':
			i++
			if i < len(expr) && expr[i] == '{' {
				end, err := skipTo(i, '{', '}')
				if err != nil {
					return nil, err
				}
				i = end
				continue
			}
			for i < len(expr) && isIdent(expr[i]) {
				i++
			}
		case c == '(':
			depth = append(depth, '(')
			i++
		case c == ')':
			if len(depth) == 0 {
				return nil, fmt.Errorf("unbalanced ')' at %d", i)
			}
			depth = depth[:len(depth)-1]
			i++
		case c == '}' || c == ']':
			return nil, fmt.Errorf("unbalanced %q at %d", c, i)
		case isIdentStart(c):
			j := i
			for j < len(expr) && isIdent(expr[j]) {
				j++
			}
			word := expr[i:j]
			next := skipSpace(j)
			switch {
			case promqlLabelLists[word]:
				if next < len(expr) && expr[next] == '(' {
					end, err := skipTo(next, '(', ')')
					if err != nil {
						return nil, err
					}
					j = end
				}
			case next < len(expr) && expr[next] == '(', promqlNonMetrics[word]:
			default:
				if !slices.Contains(names, word) {
					names = append(names, word)
				}
			}
			i = j
		default:
			return nil, fmt.Errorf("unexpected %q at %d", c, i)
		}
	}
	if len(depth) > 0 {
		return nil, fmt.Errorf("%d unclosed '('", len(depth))
	}
	return names, nil
}

// TestPromQLMetricNames pins the extraction on expressions of each shape the dashboard uses, and on errors.
func TestPromQLMetricNames(t *testing.T) {
	for _, c := range []struct {
		expr string
		want []string
		err  bool
	}{
		{`sum by (trigger, result) (rate(kubelet_image_gc_attempts_total{instance=~"$instance"}[$__rate_interval]))`, []string{"kubelet_image_gc_attempts_total"}, false},
		{`histogram_quantile(0.99, sum by (le, operation) (rate(kubelet_image_gc_duration_seconds_bucket{instance=~"a|b", x!="}"}[5m])))`, []string{"kubelet_image_gc_duration_seconds_bucket"}, false},
		{`max by (node) (imagefleet_pull_tokens) - on (node) group_left max by (node) (imagefleet_pull_tokens_in_use)`, []string{"imagefleet_pull_tokens", "imagefleet_pull_tokens_in_use"}, false},
		{`sum(rate(a_total[1m])) / sum without (x) (rate(b_total[1m] offset 5m)) > bool 0 or vector(0)`, []string{"a_total", "b_total"}, false},
		{`kubelet_image_gc_attempts_total{instance=~"${instance}"}`, []string{"kubelet_image_gc_attempts_total"}, false},
		{`sum(rate(x_total[5m])`, nil, true},
		{`x_total{a="b"`, nil, true},
		{`x_total{a="b}`, nil, true},
		{`rate(x_total[5m]))`, nil, true},
	} {
		got, err := promqlMetricNames(c.expr)
		if (err != nil) != c.err || !slices.Equal(got, c.want) {
			t.Errorf("promqlMetricNames(%q) = %v, %v; want %v, error %v", c.expr, got, err, c.want, c.err)
		}
	}
}
