package main

import (
	"fmt"
	"sort"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// injectCDI does what a CDI-enabled container runtime does with the IDs kubelet hands it:
// resolve them against the spec directories with the reference library and edit an OCI spec.
// The answer is the edited spec's env, device nodes and mounts, plus every spec the library
// refused to load (a refused spec hides its devices, which would otherwise look "unresolved"
// for no visible reason).
func injectCDI(devices, specDirs []string) (map[string]any, error) {
	if len(specDirs) == 0 {
		return nil, fmt.Errorf("spec_dirs is required: the default /etc/cdi and /var/run/cdi are the host's")
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(specDirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		return nil, err
	}
	specErrors := map[string][]string{}
	for path, errs := range cache.GetErrors() {
		for _, e := range errs {
			specErrors[path] = append(specErrors[path], e.Error())
		}
	}
	spec := &oci.Spec{Version: oci.Version, Process: &oci.Process{}, Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, devices...)
	answer := map[string]any{"unresolved": nonNil(unresolved), "spec_errors": specErrors}
	if err != nil {
		// Unresolved devices are an answer, not a harness failure: tests assert on them.
		answer["inject_error"] = err.Error()
		return answer, nil
	}
	nodes := []map[string]any{}
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, map[string]any{"path": d.Path, "type": d.Type, "major": d.Major, "minor": d.Minor})
	}
	mounts := []map[string]any{}
	for _, m := range spec.Mounts {
		mounts = append(mounts, map[string]any{"source": m.Source, "destination": m.Destination,
			"type": m.Type, "options": m.Options})
	}
	hooks := 0
	if spec.Hooks != nil {
		hooks = len(spec.Hooks.CreateRuntime) + len(spec.Hooks.CreateContainer) +
			len(spec.Hooks.StartContainer) + len(spec.Hooks.Poststart) + len(spec.Hooks.Poststop) +
			len(spec.Hooks.Prestart) //nolint:staticcheck // runtimes still run prestart hooks
	}
	vendors := cache.ListVendors()
	sort.Strings(vendors)
	answer["env"] = nonNil(spec.Process.Env)
	answer["device_nodes"] = nodes
	answer["mounts"] = mounts
	answer["hooks"] = hooks
	answer["vendors"] = vendors
	return answer, nil
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}
