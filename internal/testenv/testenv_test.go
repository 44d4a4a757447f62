package testenv

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite the knob table in docs/testing.md")

// fatalRecorder is a testing.TB whose Fatalf records the message and ends the calling goroutine, as the
// real one does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}
func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// fatal runs read with a recorder and returns what it failed with ("" when it did not).
func fatal(t *testing.T, read func(tb testing.TB)) string {
	t.Helper()
	r := &fatalRecorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		read(r)
	}()
	<-done
	return r.msg
}

// clearKnobs unsets every IMAGEFLEET_* variable for the test, so the host's own do not leak in.
func clearKnobs(t *testing.T) {
	for _, kv := range os.Environ() {
		if name, _, _ := strings.Cut(kv, "="); strings.HasPrefix(name, Prefix) {
			t.Setenv(name, "") // restores the value after the test
			os.Unsetenv(name)
		}
	}
}

func TestCheck(t *testing.T) {
	clearKnobs(t)
	if err := Check(); err != nil {
		t.Fatalf("no IMAGEFLEET_* set: %v", err)
	}
	t.Setenv("IMAGEFLEET_OUTAGE", "30s")
	t.Setenv("OTHER_FOO", "1") // not ours
	if err := Check(); err != nil {
		t.Fatalf("declared knob set: %v", err)
	}
	t.Setenv("IMAGEFLEET_FOO", "1")
	t.Setenv("IMAGEFLEET_FAULTSEED", "42")      // IMAGEFLEET_FAULT_SEED without its underscore
	t.Setenv("IMAGEFLEET_SCALE_NODES", "10000") // retired: a row now
	err := Check()
	if err == nil {
		t.Fatal("IMAGEFLEET_FOO, IMAGEFLEET_FAULTSEED and IMAGEFLEET_SCALE_NODES passed Check")
	}
	for _, want := range []string{"IMAGEFLEET_FOO is set but no test reads it (a typo?)", "IMAGEFLEET_FAULTSEED is set", "docs/testing.md",
		"IMAGEFLEET_SCALE_NODES is set but no test reads it now: fleet sizes are rows: -bench 'HollowFleet$/nodes=10000$'"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Check() = %q, want it to contain %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "IMAGEFLEET_OUTAGE") {
		t.Errorf("Check() = %q names a declared knob", err)
	}
}

func TestGetters(t *testing.T) {
	clearKnobs(t)
	if got := Duration(t, "IMAGEFLEET_OUTAGE"); got != 3*time.Second {
		t.Errorf("unset IMAGEFLEET_OUTAGE = %v, want the default 3s", got)
	}
	t.Setenv("IMAGEFLEET_OUTAGE", "30s")
	if got := Duration(t, "IMAGEFLEET_OUTAGE"); got != 30*time.Second {
		t.Errorf("IMAGEFLEET_OUTAGE=30s read as %v", got)
	}
	t.Setenv("IMAGEFLEET_FAULT_ROUNDS", "100")
	if got := Int(t, "IMAGEFLEET_FAULT_ROUNDS"); got != 100 {
		t.Errorf("IMAGEFLEET_FAULT_ROUNDS=100 read as %d", got)
	}
	if got := String(t, "IMAGEFLEET_BASELINE_BINARY"); got != "" {
		t.Errorf("unset IMAGEFLEET_BASELINE_BINARY = %q", got)
	}
	if got := Lookup("IMAGEFLEET_KUBE_CACHE"); got != "/var/cache/imagefleet/kube" {
		t.Errorf("unset IMAGEFLEET_KUBE_CACHE = %q, want its default", got)
	}
	t.Setenv("IMAGEFLEET_KUBE_CACHE", "/tmp/kube")
	if got := Lookup("IMAGEFLEET_KUBE_CACHE"); got != "/tmp/kube" {
		t.Errorf("IMAGEFLEET_KUBE_CACHE=/tmp/kube read as %q", got)
	}
	if IsSet("IMAGEFLEET_FAULT_SEED") {
		t.Error("IsSet of an unset knob")
	}
	t.Setenv("IMAGEFLEET_FAULT_SEED", "42")
	if !IsSet("IMAGEFLEET_FAULT_SEED") || Int(t, "IMAGEFLEET_FAULT_SEED") != 42 {
		t.Error("IMAGEFLEET_FAULT_SEED=42 not read")
	}
}

// TestKinds reads every kind through a knob of that kind made for the test.
func TestKinds(t *testing.T) {
	clearKnobs(t)
	saved := Knobs
	t.Cleanup(func() { Knobs = saved })
	Knobs = []Knob{
		{Name: "IMAGEFLEET_T_BOOL", Kind: KindBool, Default: "false"},
		{Name: "IMAGEFLEET_T_LIST", Kind: KindList, Default: "file,memory"},
		{Name: "IMAGEFLEET_T_INTS", Kind: KindInts, Default: "1000", Positive: true},
	}
	if Bool(t, "IMAGEFLEET_T_BOOL") {
		t.Error("default false read as true")
	}
	t.Setenv("IMAGEFLEET_T_BOOL", "true")
	if !Bool(t, "IMAGEFLEET_T_BOOL") {
		t.Error("true read as false")
	}
	if got := List(t, "IMAGEFLEET_T_LIST"); !slices.Equal(got, []string{"file", "memory"}) {
		t.Errorf("default list = %q", got)
	}
	t.Setenv("IMAGEFLEET_T_LIST", " memory ")
	if got := List(t, "IMAGEFLEET_T_LIST"); !slices.Equal(got, []string{"memory"}) {
		t.Errorf("IMAGEFLEET_T_LIST=' memory ' read as %q", got)
	}
	if got := Ints(t, "IMAGEFLEET_T_INTS"); !slices.Equal(got, []int{1000}) {
		t.Errorf("unset IMAGEFLEET_T_INTS = %v, want [1000]", got)
	}
	t.Setenv("IMAGEFLEET_T_INTS", "1000, 10000")
	if got := Ints(t, "IMAGEFLEET_T_INTS"); !slices.Equal(got, []int{1000, 10000}) {
		t.Errorf("IMAGEFLEET_T_INTS=1000, 10000 read as %v", got)
	}
}

func TestBadValues(t *testing.T) {
	clearKnobs(t)
	saved := Knobs
	t.Cleanup(func() { Knobs = saved })
	Knobs = append(slices.Clone(Knobs), Knob{Name: "IMAGEFLEET_T_INTS", Kind: KindInts, Default: "1000", Positive: true})
	for _, c := range []struct {
		name, value string
		read        func(tb testing.TB)
		want        string
	}{
		{"int", "abc", func(tb testing.TB) { Int(tb, "IMAGEFLEET_FAULT_ROUNDS") },
			`IMAGEFLEET_FAULT_ROUNDS="abc" (set): want a positive integer; see docs/testing.md`},
		{"not positive", "0", func(tb testing.TB) { Int(tb, "IMAGEFLEET_FAULT_ROUNDS") },
			`IMAGEFLEET_FAULT_ROUNDS="0" (set): want a positive integer`},
		{"int without Positive", "x", func(tb testing.TB) { Int(tb, "IMAGEFLEET_FAULT_SEED") },
			`IMAGEFLEET_FAULT_SEED="x" (set): want an integer`},
		{"duration", "30", func(tb testing.TB) { Duration(tb, "IMAGEFLEET_OUTAGE") },
			`IMAGEFLEET_OUTAGE="30" (set): want a Go duration such as 30s or 5m`},
		{"ints", "1000,ten", func(tb testing.TB) { Ints(tb, "IMAGEFLEET_T_INTS") },
			`IMAGEFLEET_T_INTS="1000,ten" (set): want a positive integer, comma-separated`},
	} {
		t.Run(c.name, func(t *testing.T) {
			knob := strings.Fields(c.want)[0]
			knob, _, _ = strings.Cut(knob, "=")
			t.Setenv(knob, c.value)
			if got := fatal(t, c.read); !strings.HasPrefix(got, c.want) {
				t.Errorf("failed with %q, want it to start %q", got, c.want)
			}
		})
	}
}

func TestUndeclaredPanics(t *testing.T) {
	for name, read := range map[string]func(){
		"undeclared": func() { String(t, "IMAGEFLEET_FOO") },
		"wrong kind": func() { Int(t, "IMAGEFLEET_OUTAGE") },
		"no default": func() { clearKnobs(t); Int(t, "IMAGEFLEET_FAULT_SEED") },
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if r := recover(); r == nil || !strings.HasPrefix(fmt.Sprint(r), "testenv: IMAGEFLEET_") {
					t.Errorf("recovered %v, want a testenv panic naming the variable", r)
				}
			}()
			read()
		})
	}
}

// TestTable: names are unique and well formed, and every default parses.
func TestTable(t *testing.T) {
	seen := map[string]bool{}
	for _, k := range Knobs {
		if !strings.HasPrefix(k.Name, Prefix) || strings.ToUpper(k.Name) != k.Name || seen[k.Name] {
			t.Errorf("%q: want a unique upper-case name starting %s", k.Name, Prefix)
		}
		seen[k.Name] = true
		if k.Doc == "" {
			t.Errorf("%s has no Doc", k.Name)
		}
		if k.Default != "" {
			if _, err := k.parse(k.Default); err != nil {
				t.Errorf("%s's default %q: %v", k.Name, k.Default, err)
			}
		}
	}
	for name, hint := range Retired {
		if !strings.HasPrefix(name, Prefix) || seen[name] || hint == "" {
			t.Errorf("retired %q: want a name starting %s that Knobs does not declare, and where its setting went", name, Prefix)
		}
	}
}

// TestRows: the default rows run under any pattern, an Explicit one only under a pattern that names it.
func TestRows(t *testing.T) {
	f := flag.Lookup("test.bench")
	saved := f.Value.String()
	t.Cleanup(func() { f.Value.Set(saved) })
	rows := IntRows("nodes", []int{1000}, []int{1500, 10000})
	names := func(rows []Row[int]) []string {
		var out []string
		for _, r := range rows {
			out = append(out, r.Name)
		}
		return out
	}
	if got, want := names(rows), []string{"nodes=1000", "nodes=1500", "nodes=10000"}; !slices.Equal(got, want) {
		t.Fatalf("IntRows = %q, want %q", got, want)
	}
	if !rows[2].Explicit || rows[2].Value != 10000 || rows[0].Explicit {
		t.Fatalf("IntRows = %+v", rows)
	}
	for _, c := range []struct {
		pattern string
		want    []string
	}{
		{"", []string{"nodes=1000"}},
		{".", []string{"nodes=1000"}},
		{"HollowFleet$", []string{"nodes=1000"}},
		{"HollowFleet$/nodes=1.*", []string{"nodes=1000"}},
		{"HollowFleet$/nodes=10000$", []string{"nodes=1000", "nodes=10000"}},
		{"(HollowFleet|InventoryCatchUp)$/(nodes=1500|nodes=10000)$/streams=r3-pull-r1", []string{"nodes=1000", "nodes=1500", "nodes=10000"}},
		{"HollowFleet$/nodes=1500$|InventoryCatchUp$/nodes=10000$", []string{"nodes=1000", "nodes=1500", "nodes=10000"}},
		{"HollowFleet$/nodes=(1500|10000)$", []string{"nodes=1000"}}, // matches them, names neither
	} {
		if err := f.Value.Set(c.pattern); err != nil {
			t.Fatal(err)
		}
		if got := names(Rows(rows)); !slices.Equal(got, c.want) {
			t.Errorf("-bench %q: rows %q, want %q", c.pattern, got, c.want)
		}
	}
	if err := f.Value.Set("X/streams=r3-pull-r1"); err != nil {
		t.Fatal(err)
	}
	if Named("streams=r1") || !Named("streams=r3-pull-r1") || Named("") {
		t.Error("Named")
	}
}

const docFile, begin, end = "../../docs/testing.md", "<!-- knobs: generated by go test ./internal/testenv -update -->\n", "<!-- end of knobs -->\n"

// TestDocs: docs/testing.md shows the table as it is (go test ./internal/testenv -update rewrites it).
func TestDocs(t *testing.T) {
	raw, err := os.ReadFile(docFile)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	i, j := strings.Index(doc, begin), strings.Index(doc, end)
	if i < 0 || j < i {
		t.Fatalf("%s has no %q ... %q markers", docFile, begin, end)
	}
	want := doc[:i+len(begin)] + Markdown() + doc[j:]
	if want == doc {
		return
	}
	if *update {
		if err := os.WriteFile(docFile, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	t.Errorf("%s's knob table is out of date: run go test ./internal/testenv -update", docFile)
}
