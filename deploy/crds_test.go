package deploy_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"testing"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"
)

// TestCRDsGenerated: the chart's CRDs are what controller-gen makes of api/v1alpha1 now (go tool task crds
// writes them).
func TestCRDsGenerated(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command("go", "tool", "controller-gen", "paths=./api/...", "crd:crdVersions=v1", "output:crd:dir="+dir)
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("controller-gen: %v\n%s", err, out)
	}
	fresh, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	kept, _ := filepath.Glob(filepath.Join(chartDir, "files", "crds", "*.yaml"))
	if len(fresh) != 3 || len(kept) != len(fresh) {
		t.Fatalf("generated %v, in the chart %v", fresh, kept)
	}
	for _, f := range fresh {
		want, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(filepath.Join(chartDir, "files", "crds", filepath.Base(f)))
		if err != nil || string(got) != string(want) {
			t.Errorf("%s is out of date (%v): run go tool task crds", filepath.Base(f), err)
		}
	}
}

// TestChartCRDs: the chart installs the generated CRDs as they are, kept on uninstall, and none with
// crds.install=false.
func TestChartCRDs(t *testing.T) {
	files, _ := filepath.Glob(filepath.Join(chartDir, "files", "crds", "*.yaml"))
	want := map[string]apiextensionsv1.CustomResourceDefinitionSpec{}
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var crd apiextensionsv1.CustomResourceDefinition
		if err := yaml.UnmarshalStrict(raw, &crd); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		want[crd.Name] = crd.Spec
	}
	got := map[string]apiextensionsv1.CustomResourceDefinitionSpec{}
	for _, d := range renderChart(t) {
		crd, ok := d.obj.(*apiextensionsv1.CustomResourceDefinition)
		if !ok {
			continue
		}
		got[crd.Name] = crd.Spec
		if crd.Annotations["helm.sh/resource-policy"] != "keep" || crd.Labels["app.kubernetes.io/component"] != "crds" {
			t.Errorf("%s: annotations %v, labels %v", crd.Name, crd.Annotations, crd.Labels)
		}
	}
	if len(want) != 3 || !reflect.DeepEqual(got, want) {
		t.Errorf("rendered CRDs %d, generated %d (or their specs differ)", len(got), len(want))
	}
	for _, d := range renderChart(t, "--set", "crds.install=false") {
		if d.kind == "CustomResourceDefinition" {
			t.Errorf("crds.install=false renders %s", d.name)
		}
	}
}
