package testenv

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Prefix starts every variable the table governs.
const Prefix = "IMAGEFLEET_"

// docs names where a failure sends the reader.
const docs = "docs/testing.md (declared in internal/testenv/knobs.go)"

// Check returns an error naming each IMAGEFLEET_* variable of the environment that Knobs does not declare
// (for a Retired one, where its setting went).
func Check() error {
	var errs []error
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch {
		case !strings.HasPrefix(name, Prefix) || lookup(name) != nil:
			// not ours, or declared
		case Retired[name] != "":
			errs = append(errs, fmt.Errorf("testenv: %s is set but no test reads it now: %s; see %s", name, Retired[name], docs))
		default:
			errs = append(errs, fmt.Errorf("testenv: %s is set but no test reads it (a typo?); the knobs are in %s", name, docs))
		}
	}
	return errors.Join(errs...)
}

// MustCheck runs Check and, when it fails, prints the error and exits with status 2. A test package that
// reads knobs calls it from an init function in a _test.go file, so the whole binary refuses to run.
func MustCheck() {
	if err := Check(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}

// IsSet reports whether the declared knob name is set to a non-empty value.
func IsSet(name string) bool {
	mustKnob(name, "")
	return os.Getenv(name) != ""
}

// String returns the knob's value, its default when unset.
func String(tb testing.TB, name string) string {
	tb.Helper()
	return get(tb, name, KindString).(string)
}

// Lookup returns a string knob's value, its default when unset. A string cannot fail to parse, so it needs
// no testing.TB: helpers that run outside a test's call (the kube lab's binary lookup) read their knobs here.
func Lookup(name string) string {
	k := mustKnob(name, KindString)
	if v := os.Getenv(name); v != "" {
		return v
	}
	return k.Default
}

// Int returns the knob's value, its default when unset; a knob without a default must be IsSet.
func Int(tb testing.TB, name string) int {
	tb.Helper()
	return get(tb, name, KindInt).(int)
}

// Duration returns the knob's value, its default when unset; a knob without a default must be IsSet.
func Duration(tb testing.TB, name string) time.Duration {
	tb.Helper()
	return get(tb, name, KindDuration).(time.Duration)
}

// Bool returns the knob's value, its default when unset; a knob without a default must be IsSet.
func Bool(tb testing.TB, name string) bool {
	tb.Helper()
	return get(tb, name, KindBool).(bool)
}

// List returns the knob's comma-separated values, trimmed, its default when unset.
func List(tb testing.TB, name string) []string {
	tb.Helper()
	return get(tb, name, KindList).([]string)
}

// Ints returns the knob's comma-separated integers, its default when unset.
func Ints(tb testing.TB, name string) []int {
	tb.Helper()
	return get(tb, name, KindInts).([]int)
}

// get fails tb when the value does not parse; it panics when name is undeclared or of another kind, as
// that is a mistake in the test's code, not in its environment.
func get(tb testing.TB, name string, kind Kind) any {
	tb.Helper()
	k := mustKnob(name, kind)
	raw, from := os.Getenv(name), "set"
	if raw == "" {
		raw, from = k.Default, "default"
		if raw == "" && kind != KindString && kind != KindList && kind != KindInts {
			panic(fmt.Sprintf("testenv: %s has no default: ask IsSet before reading it", name))
		}
	}
	v, err := k.parse(raw)
	if err != nil {
		tb.Fatalf("%s=%q (%s): %v; see %s", name, raw, from, err, docs)
	}
	return v
}

func mustKnob(name string, kind Kind) *Knob {
	k := lookup(name)
	if k == nil {
		panic(fmt.Sprintf("testenv: %s is not declared: add it to Knobs in internal/testenv/knobs.go and to docs/testing.md", name))
	}
	if kind != "" && k.Kind != kind {
		panic(fmt.Sprintf("testenv: %s is a %s knob, read as a %s", name, k.Kind, kind))
	}
	return k
}

func lookup(name string) *Knob {
	i := slices.IndexFunc(Knobs, func(k Knob) bool { return k.Name == name })
	if i < 0 {
		return nil
	}
	return &Knobs[i]
}

// parse reads raw as k's kind ("" for a String or list: empty).
func (k *Knob) parse(raw string) (any, error) {
	switch k.Kind {
	case KindString:
		return raw, nil
	case KindInt:
		n, err := k.parseInt(raw)
		return n, err
	case KindDuration:
		d, err := time.ParseDuration(raw)
		if err != nil {
			return d, fmt.Errorf("want a Go duration such as 30s or 5m")
		}
		if k.Positive && d <= 0 {
			return d, fmt.Errorf("want a positive duration")
		}
		return d, nil
	case KindBool:
		b, err := strconv.ParseBool(raw)
		if err != nil {
			return b, fmt.Errorf("want true or false")
		}
		return b, nil
	case KindList:
		return split(raw), nil
	case KindInts:
		var out []int
		for _, f := range split(raw) {
			n, err := k.parseInt(f)
			if err != nil {
				return nil, fmt.Errorf("%v, comma-separated", err)
			}
			out = append(out, n)
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown kind %q", k.Kind)
}

func (k *Knob) parseInt(raw string) (int, error) {
	n, err := strconv.Atoi(raw)
	switch {
	case err != nil && k.Positive:
		return 0, fmt.Errorf("want a positive integer")
	case err != nil:
		return 0, fmt.Errorf("want an integer")
	case k.Positive && n <= 0:
		return 0, fmt.Errorf("want a positive integer")
	}
	return n, nil
}

// split returns raw's comma-separated fields, trimmed; none for "".
func split(raw string) []string {
	if strings.TrimSpace(raw) == "" {
		return nil
	}
	fs := strings.Split(raw, ",")
	for i := range fs {
		fs[i] = strings.TrimSpace(fs[i])
	}
	return fs
}

// Markdown is the table of Knobs as docs/testing.md shows it.
func Markdown() string {
	var sb strings.Builder
	sb.WriteString("| variable | type | default | what it does |\n| --- | --- | --- | --- |\n")
	for _, k := range Knobs {
		def := "unset"
		if k.Default != "" {
			def = "`" + k.Default + "`"
		}
		kind := string(k.Kind)
		if k.Positive {
			kind += ", > 0"
		}
		fmt.Fprintf(&sb, "| `%s` | %s | %s | %s |\n", k.Name, kind, def, strings.ReplaceAll(k.Doc, "|", `\|`))
	}
	return sb.String()
}
