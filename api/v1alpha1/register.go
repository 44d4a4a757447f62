package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// GroupVersion is the API's group and version.
var GroupVersion = schema.GroupVersion{Group: "imagefleet.io", Version: "v1alpha1"}

// SchemeBuilder adds the API's types to a scheme; AddToScheme is its AddToScheme.
var (
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)
	AddToScheme   = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion, &ImagePrePull{}, &ImagePrePullList{}, &ImageGC{}, &ImageGCList{},
		&ImageGCPolicy{}, &ImageGCPolicyList{})
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
