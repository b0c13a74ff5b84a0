// Package types mirrors the one type of k8s.io/apimachinery/pkg/types that
// the llm-d framework mirror needs: the identity of an endpoint.
package types

// NamespacedName is a Kubernetes object's namespace and name.
type NamespacedName struct {
	Namespace string
	Name      string
}

// String renders the name as "namespace/name".
func (n NamespacedName) String() string { return n.Namespace + "/" + n.Name }
