// celcheck judges the CEL of the deployment manifests with Kubernetes's own code
// (k8s.io/dynamic-resource-allocation/cel and the ValidatingAdmissionPolicy plugin of
// k8s.io/apiserver, at the version pinned in go.mod), without an API server:
//
//   - device selectors (DeviceClasses, example claims) are compiled as the API server and
//     the scheduler compile them, then evaluated against ResourceSlice devices;
//   - a ValidatingAdmissionPolicy is compiled as the admission plugin compiles it, then
//     decided for admission requests (operation, user, user extra, object, old object).
//
// Input on stdin, output on stdout, both JSON (tests/deploy/test_cel.py writes and reads
// them). Exit status 0 when it could answer, 2 on bad input.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/admission"
	plugincel "k8s.io/apiserver/pkg/admission/plugin/cel"
	"k8s.io/apiserver/pkg/admission/plugin/policy/validating"
	"k8s.io/apiserver/pkg/admission/plugin/webhook/matchconditions"
	celconfig "k8s.io/apiserver/pkg/apis/cel"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/cel/environment"
	dracel "k8s.io/dynamic-resource-allocation/cel"
)

type selector struct {
	Name       string `json:"name"`
	Expression string `json:"expression"`
}

type device struct {
	Driver string             `json:"driver"`
	Device resourceapi.Device `json:"device"`
}

type request struct {
	Name      string              `json:"name"`
	Operation string              `json:"operation"`
	User      string              `json:"user"`
	Extra     map[string][]string `json:"extra"`
	Object    map[string]any      `json:"object"`
	OldObject map[string]any      `json:"oldObject"`
}

type input struct {
	Selectors []selector                             `json:"selectors"`
	Devices   []device                               `json:"devices"`
	Policy    *admissionv1.ValidatingAdmissionPolicy `json:"policy"`
	Requests  []request                              `json:"requests"`
}

type selectorResult struct {
	Error      string            `json:"error,omitempty"`
	Matches    []string          `json:"matches"`
	EvalErrors map[string]string `json:"eval_errors,omitempty"`
}

type decision struct {
	// Matched: the policy applies to the request (its match conditions hold).
	Matched  bool     `json:"matched"`
	Allowed  bool     `json:"allowed"`
	Messages []string `json:"messages"`
}

type output struct {
	Selectors map[string]selectorResult `json:"selectors"`
	Requests  map[string]decision       `json:"requests"`
}

func main() {
	var in input
	if err := json.NewDecoder(os.Stdin).Decode(&in); err != nil {
		fmt.Fprintln(os.Stderr, "input:", err)
		os.Exit(2)
	}
	out := output{Selectors: map[string]selectorResult{}, Requests: map[string]decision{}}
	for _, s := range in.Selectors {
		out.Selectors[s.Name] = evaluateSelector(s, in.Devices)
	}
	if in.Policy != nil {
		validator := compilePolicy(in.Policy)
		for _, r := range in.Requests {
			d, err := decide(in.Policy, validator, r)
			if err != nil {
				fmt.Fprintf(os.Stderr, "request %s: %v\n", r.Name, err)
				os.Exit(2)
			}
			out.Requests[r.Name] = d
		}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
}

func evaluateSelector(s selector, devices []device) selectorResult {
	// The gates off: what Kubernetes 1.34 accepts by default must be enough.
	compiled := dracel.GetCompiler(dracel.Features{}).CompileCELExpression(s.Expression, dracel.Options{})
	if compiled.Error != nil {
		return selectorResult{Error: compiled.Error.Error(), Matches: []string{}}
	}
	result := selectorResult{Matches: []string{}, EvalErrors: map[string]string{}}
	for _, d := range devices {
		matches, _, err := compiled.DeviceMatches(context.Background(), dracel.Device{
			Driver: d.Driver, Attributes: d.Device.Attributes, Capacity: d.Device.Capacity})
		if err != nil {
			result.EvalErrors[d.Device.Name] = err.Error()
		} else if matches {
			result.Matches = append(result.Matches, d.Device.Name)
		}
	}
	return result
}

// compilePolicy builds the policy's validator the way the admission plugin does
// (policy/validating.compilePolicy, unexported there).
func compilePolicy(policy *admissionv1.ValidatingAdmissionPolicy) validating.Validator {
	optional := plugincel.OptionalVariableDeclarations{HasParams: policy.Spec.ParamKind != nil, HasAuthorizer: true}
	messageOptional := plugincel.OptionalVariableDeclarations{HasParams: policy.Spec.ParamKind != nil}
	compiler, err := plugincel.NewCompositedCompiler(environment.MustBaseEnvSet(environment.DefaultCompatibilityVersion()))
	if err != nil {
		return validating.NewValidator(nil, nil, nil, nil, policy.Spec.FailurePolicy, err)
	}
	variables := make([]plugincel.NamedExpressionAccessor, len(policy.Spec.Variables))
	for i, v := range policy.Spec.Variables {
		variables[i] = &validating.Variable{Name: v.Name, Expression: v.Expression}
	}
	compiler.CompileAndStoreVariables(variables, optional, environment.StoredExpressions)
	var matcher matchconditions.Matcher
	if len(policy.Spec.MatchConditions) > 0 {
		conditions := make([]plugincel.ExpressionAccessor, len(policy.Spec.MatchConditions))
		for i := range policy.Spec.MatchConditions {
			conditions[i] = (*matchconditions.MatchCondition)(&policy.Spec.MatchConditions[i])
		}
		matcher = matchconditions.NewMatcher(compiler.CompileCondition(conditions, optional, environment.StoredExpressions),
			policy.Spec.FailurePolicy, "policy", "validate", policy.Name)
	}
	validations := make([]plugincel.ExpressionAccessor, len(policy.Spec.Validations))
	messages := make([]plugincel.ExpressionAccessor, len(policy.Spec.Validations))
	for i, v := range policy.Spec.Validations {
		validations[i] = &validating.ValidationCondition{Expression: v.Expression, Message: v.Message, Reason: v.Reason}
		if v.MessageExpression != "" {
			messages[i] = &validating.MessageExpressionCondition{MessageExpression: v.MessageExpression}
		}
	}
	return validating.NewValidator(compiler.CompileCondition(validations, optional, environment.StoredExpressions),
		matcher, compiler.CompileCondition(nil, optional, environment.StoredExpressions),
		compiler.CompileCondition(messages, messageOptional, environment.StoredExpressions),
		policy.Spec.FailurePolicy, nil)
}

func decide(policy *admissionv1.ValidatingAdmissionPolicy, validator validating.Validator, r request) (decision, error) {
	gvk := schema.GroupVersionKind{Group: "resource.k8s.io", Version: "v1", Kind: "ResourceSlice"}
	gvr := schema.GroupVersionResource{Group: "resource.k8s.io", Version: "v1", Resource: "resourceslices"}
	var object, oldObject runtime.Object
	name := ""
	if r.Object != nil {
		u := &unstructured.Unstructured{Object: r.Object}
		object, name = u, u.GetName()
	}
	if r.OldObject != nil {
		u := &unstructured.Unstructured{Object: r.OldObject}
		oldObject, name = u, u.GetName()
	}
	who := &user.DefaultInfo{Name: r.User, Groups: []string{"system:authenticated"}, Extra: r.Extra}
	attrs := admission.NewAttributesRecord(object, oldObject, gvk, "", name, gvr, "",
		admission.Operation(r.Operation), nil, false, who)
	versioned := &admission.VersionedAttributes{Attributes: attrs, VersionedKind: gvk,
		VersionedObject: admission.NewLazyObject(object), VersionedOldObject: admission.NewLazyObject(oldObject)}
	result := validator.Validate(context.Background(), gvr, versioned, nil, nil,
		celconfig.RuntimeCELCostBudget, nil)
	d := decision{Matched: len(result.Decisions) > 0, Allowed: true, Messages: []string{}}
	for _, decided := range result.Decisions {
		if decided.Action == validating.ActionDeny {
			d.Allowed = false
			d.Messages = append(d.Messages, decided.Message)
		}
	}
	return d, nil
}
