package events

import (
	stdjson "encoding/json"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/go-json-experiment/json"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// samplePod is a pod with secrets and configmaps referenced every way a Pod can (as the pod index's
// benchmark pods).
func samplePod(k, round int) *v1.Pod {
	return &v1.Pod{
		TypeMeta: metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Namespace: fmt.Sprintf("ns-%d", k%20), Name: fmt.Sprintf("pod-%d", k),
			UID: types.UID(fmt.Sprintf("uid-%d", k)), Labels: map[string]string{"round": fmt.Sprint(round)}},
		Spec: v1.PodSpec{
			ImagePullSecrets: []v1.LocalObjectReference{{Name: fmt.Sprintf("pull-%d", k%7)}},
			Containers: []v1.Container{{
				Name: "app", Image: fmt.Sprintf("registry.example/app-%d:1.%d", k%50, round),
				EnvFrom: []v1.EnvFromSource{{SecretRef: &v1.SecretEnvSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("env-%d", k%31)}}}},
				Env: []v1.EnvVar{{Name: "CFG", ValueFrom: &v1.EnvVarSource{ConfigMapKeyRef: &v1.ConfigMapKeySelector{
					LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("cfg-%d", k%13)}, Key: "k"}}}},
			}},
			Volumes: []v1.Volume{
				{Name: "tls", VolumeSource: v1.VolumeSource{Secret: &v1.SecretVolumeSource{SecretName: fmt.Sprintf("tls-%d", k%17)}}},
				{Name: "conf", VolumeSource: v1.VolumeSource{ConfigMap: &v1.ConfigMapVolumeSource{LocalObjectReference: v1.LocalObjectReference{Name: fmt.Sprintf("conf-%d", k%11)}}}},
			},
		},
		Status: v1.PodStatus{Phase: v1.PodRunning},
	}
}

// richPod uses the parts of a Pod with their own JSON methods (times, quantities, int-or-string) and the
// optional pointers, maps and slices, so the differential fuzz starts from every kind of field.
func richPod() *v1.Pod {
	grace := int64(30)
	root := true
	p := samplePod(3, 1)
	p.CreationTimestamp = metav1.Unix(1700000000, 0)
	p.DeletionGracePeriodSeconds = &grace
	p.Annotations = map[string]string{"kubernetes.io/config.source": "file", "kubernetes.io/config.hash": "abc"}
	p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: "n", UID: "owner", Controller: &root}}
	c := &p.Spec.Containers[0]
	c.Resources = v1.ResourceRequirements{Limits: v1.ResourceList{v1.ResourceCPU: resource.MustParse("500m"), v1.ResourceMemory: resource.MustParse("1Gi")}}
	c.Ports = []v1.ContainerPort{{ContainerPort: 8080, Protocol: v1.ProtocolTCP}}
	c.LivenessProbe = &v1.Probe{ProbeHandler: v1.ProbeHandler{HTTPGet: &v1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}}, PeriodSeconds: 5}
	c.SecurityContext = &v1.SecurityContext{RunAsNonRoot: &root}
	p.Spec.InitContainers = []v1.Container{{Name: "init", Image: "busybox", Command: []string{"sh", "-c", "true"}}}
	p.Spec.Volumes = append(p.Spec.Volumes, v1.Volume{Name: "proj", VolumeSource: v1.VolumeSource{Projected: &v1.ProjectedVolumeSource{
		Sources: []v1.VolumeProjection{{Secret: &v1.SecretProjection{LocalObjectReference: v1.LocalObjectReference{Name: "p-s"}}}}}}})
	p.Status.Conditions = []v1.PodCondition{{Type: v1.PodReady, Status: v1.ConditionTrue, LastTransitionTime: metav1.Unix(1700000100, 0)}}
	p.Status.ContainerStatuses = []v1.ContainerStatus{{Name: "app", Ready: true, RestartCount: 2, ImageID: "sha256:1",
		State: v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: metav1.Unix(1700000050, 0)}}}}
	return p
}

// FuzzPodDecoderMatchesEncodingJSON is the differential test of the pod decoder: for any body,
// unmarshalPod (what DecodePodEvent uses) must accept exactly what encoding/json accepts and decode it to the
// same Pod.
func FuzzPodDecoderMatchesEncodingJSON(f *testing.F) {
	for _, p := range []*v1.Pod{samplePod(1, 0), richPod()} {
		b, err := stdjson.Marshal(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, s := range []string{
		`{"metadata":{"name":"a","namespace":"ns","uid":"u"}}`,
		`{"Metadata":{"NAME":"a","namespace":"ns","uid":"u"}}`,                   // names match without case
		`{"metadata":{"name":"a","name":"b","namespace":"ns","uid":"u"}}`,        // duplicate names: last wins
		"{\"metadata\":{\"name\":\"a\xff\",\"namespace\":\"ns\",\"uid\":\"u\"}}", // invalid UTF-8
		`{"metadata":{"name":"\ud800","namespace":"ns","uid":"u"}}`,              // lone surrogate
		`{"metadata":{"name":"a","namespace":"ns","uid":"u"}} x`,                 // trailing data
		`{"metadata":{"name":"a","namespace":"ns","uid":"u","generation":1e3}}`,  // float for an int
		`{"metadata":{"name":"a","namespace":"ns","uid":"u","generation":99999999999999999999}}`,
		`{"metadata":{"name":null,"namespace":"ns","uid":"u","labels":null}}`,
		`{"spec":{"containers":[{"name":"c","resources":{"limits":{"cpu":"1.5.5"}}}]}}`, // a bad quantity
		`{"metadata":{"creationTimestamp":"yesterday"}}`,                                // a bad time
		`{"spec":{"containers":[{"livenessProbe":{"httpGet":{"port":true}}}]}}`,         // a bad int-or-string
		`{"metadata":{"labels":{"a":1}}}`,
		`[]`, `null`, `""`, ``, `{`, `{"metadata":{}}`, ` {"status":{"phase":"Running"}} `,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var want, got v1.Pod
		wantErr := stdjson.Unmarshal(body, &want)
		gotErr := unmarshalPod(body, &got)
		if (wantErr == nil) != (gotErr == nil) {
			t.Fatalf("encoding/json error %v, go-json-experiment error %v, for %q", wantErr, gotErr, body)
		}
		if wantErr == nil && !reflect.DeepEqual(want, got) {
			t.Fatalf("decoded pods differ for %q:\nencoding/json:       %+v\ngo-json-experiment: %+v", body, want, got)
		}
	})
}

// TestPodFieldNamesDifferWithoutCase backs podJSON: without the legacy error reporting, a JSON name that
// matches several fields of a struct without case would be an error where encoding/json picks one. No struct
// a Pod reaches has two JSON names equal without case (embedded and inline structs count as their fields).
func TestPodFieldNamesDifferWithoutCase(t *testing.T) {
	structs, collisions := caseCollisions(reflect.TypeFor[v1.Pod]())
	for _, c := range collisions {
		t.Error(c)
	}
	if len(structs) < 100 {
		t.Fatalf("walked %d struct types from v1.Pod, want the whole tree (over 100)", len(structs))
	}
	t.Logf("%d struct types checked", len(structs))

	// The check finds such a pair, through an inline struct too.
	type inner struct {
		Name string `json:"NAME"`
	}
	type outer struct {
		Meta inner  `json:",inline"`
		Name string `json:"name"`
	}
	if _, got := caseCollisions(reflect.TypeFor[[]*outer]()); len(got) != 1 {
		t.Fatalf("collisions in outer: %v, want one", got)
	}
}

// TestPodStructsAreValidForTheDecoder backs podJSON too: without the legacy error reporting, a struct type
// go-json-experiment finds invalid (two fields with one JSON name, an unexported field with a tag, and the
// other structural errors of its struct field analysis) is an error wherever that type is decoded, where
// encoding/json goes on. Every
// struct type a Pod reaches must decode {} without error with both decoders.
func TestPodStructsAreValidForTheDecoder(t *testing.T) {
	structs, _ := caseCollisions(reflect.TypeFor[v1.Pod]())
	for _, typ := range structs {
		if err := structDecodeDiff(typ); err != nil {
			t.Error(err)
		}
	}
	t.Logf("%d struct types decoded", len(structs))

	// The check finds an invalid struct type (made at run time: go vet rejects them in source).
	str := reflect.TypeFor[string]()
	twoNames := reflect.StructOf([]reflect.StructField{
		{Name: "A", Type: str, Tag: `json:"x"`}, {Name: "B", Type: str, Tag: `json:"x"`}})
	unexported := reflect.StructOf([]reflect.StructField{{Name: "a", PkgPath: "events", Type: str, Tag: `json:"a"`}})
	for _, typ := range []reflect.Type{twoNames, unexported} {
		if err := structDecodeDiff(typ); err == nil {
			t.Errorf("%s: no difference found, want podJSON to reject what encoding/json accepts", typ)
		}
	}
}

// structDecodeDiff decodes {} into a new typ with encoding/json and with unmarshalPod's options and says if
// one fails and the other does not (types with their own JSON methods, such as Quantity, reject {} in both).
func structDecodeDiff(typ reflect.Type) error {
	wantErr := stdjson.Unmarshal([]byte(`{}`), reflect.New(typ).Interface())
	gotErr := json.Unmarshal([]byte(`{}`), reflect.New(typ).Interface(), podJSON)
	if (wantErr == nil) != (gotErr == nil) {
		return fmt.Errorf("%s: decoding {}: encoding/json error %v, podJSON error %v", typ, wantErr, gotErr)
	}
	return nil
}

// caseCollisions walks the struct types root reaches and lists the JSON names of a struct that are equal
// without case.
func caseCollisions(root reflect.Type) (structs []reflect.Type, collisions []string) {
	seen := map[reflect.Type]bool{}
	var walk func(reflect.Type)
	// names adds the JSON names of struct type st to out, following embedded and inline fields.
	var names func(st reflect.Type, out map[string][]string)
	names = func(st reflect.Type, out map[string][]string) {
		for i := range st.NumField() {
			f := st.Field(i)
			name, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
			if name == "-" && opts == "" {
				continue
			}
			ft := f.Type
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if (f.Anonymous && name == "" || strings.Contains(","+opts+",", ",inline,")) && ft.Kind() == reflect.Struct {
				names(ft, out)
				continue
			}
			if !f.IsExported() {
				continue
			}
			if name == "" {
				name = f.Name
			}
			key := strings.ToLower(name)
			out[key] = append(out[key], st.String()+"."+f.Name+" ("+name+")")
			walk(f.Type)
		}
	}
	walk = func(typ reflect.Type) {
		for typ.Kind() == reflect.Pointer || typ.Kind() == reflect.Slice || typ.Kind() == reflect.Array || typ.Kind() == reflect.Map {
			typ = typ.Elem()
		}
		if typ.Kind() != reflect.Struct || seen[typ] {
			return
		}
		seen[typ] = true
		structs = append(structs, typ)
		out := map[string][]string{}
		names(typ, out)
		for key, fields := range out {
			if len(fields) > 1 {
				collisions = append(collisions, fmt.Sprintf("%s: JSON names equal without case (%q): %v", typ, key, fields))
			}
		}
	}
	walk(root)
	return structs, collisions
}
