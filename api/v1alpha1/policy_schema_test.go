package v1alpha1_test

import (
	"os"
	"strings"
	"testing"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"k8s.io/apimachinery/pkg/util/validation/field"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"sigs.k8s.io/yaml"
)

// TestImageGCPolicySchemaRules runs the chart's ImageGCPolicy CRD's CEL rules as the apiserver does (the
// CRD's own validation compiles them and bounds their cost) over specs, without an apiserver.
func TestImageGCPolicySchemaRules(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/helm/imagefleet/files/crds/imagefleet.io_imagegcpolicies.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var v1crd apiextensionsv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(raw, &v1crd); err != nil {
		t.Fatal(err)
	}
	var crd apiextensions.CustomResourceDefinition
	if err := apiextensionsv1.Convert_v1_CustomResourceDefinition_To_apiextensions_CustomResourceDefinition(&v1crd, &crd, nil); err != nil {
		t.Fatal(err)
	}
	crd.Status.StoredVersions = []string{crd.Spec.Versions[0].Name} // what the apiserver records at creation
	if errs := validation.ValidateCustomResourceDefinition(t.Context(), &crd); len(errs) > 0 {
		t.Fatalf("the CRD is invalid: %v", errs.ToAggregate())
	}
	// One version: the internal form holds its schema as the CRD's.
	s, err := structuralschema.NewStructural(crd.Spec.Validation.OpenAPIV3Schema)
	if err != nil {
		t.Fatal(err)
	}
	v := cel.NewValidator(s, true, celconfig.PerCallLimit)
	for _, tc := range []struct {
		name, spec string
		want       string // a refusal's message; "": accepted
	}{
		{"quota in bytes", `{"capacityBytes":41943040}`, ""},
		{"quota as a quantity", `{"capacityBytes":"40Mi"}`, ""},
		{"zero quota in bytes", `{"capacityBytes":0}`, "capacityBytes must be more than 0"},
		{"zero quota as a quantity", `{"capacityBytes":"0Gi"}`, "capacityBytes must be more than 0"},
		{"negative quota", `{"capacityBytes":"-1"}`, "capacityBytes must be more than 0"},
		{"ages in order", `{"minAge":"1m","maxAge":"1h"}`, ""},
		{"ages out of order", `{"minAge":"2h","maxAge":"1h"}`, "maxAge must be greater than minAge"},
		{"thresholds out of order", `{"highThresholdPercent":50,"lowThresholdPercent":50}`, "lowThresholdPercent must be less than highThresholdPercent"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var obj map[string]any
			// As the apiserver decodes: whole numbers as int64.
			if err := utiljson.Unmarshal([]byte(`{"apiVersion":"imagefleet.io/v1alpha1","kind":"ImageGCPolicy","metadata":{"name":"p"},"spec":`+tc.spec+`}`), &obj); err != nil {
				t.Fatal(err)
			}
			errs, _ := v.Validate(t.Context(), field.NewPath(""), s, obj, nil, celconfig.RuntimeCELCostBudget)
			switch {
			case tc.want == "" && len(errs) > 0:
				t.Errorf("refused: %v", errs.ToAggregate())
			case tc.want != "" && (len(errs) == 0 || !strings.Contains(errs.ToAggregate().Error(), tc.want)):
				t.Errorf("got %v, want %q", errs.ToAggregate(), tc.want)
			}
		})
	}
}
