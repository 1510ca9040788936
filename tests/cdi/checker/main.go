// cdi-check loads a CDI spec directory with the reference CDI library
// (tags.cncf.io/container-device-interface, the version pinned in go.mod) and prints what a
// container runtime would see, as JSON on stdout: every validation error the library
// records, every device it lists, for each loaded spec the cdiVersion it declares beside the
// minimum the library computes for its content, and, for the qualified device names given
// as arguments, the OCI spec after injection.
//
// Usage: cdi-check SPEC_DIR [vendor/class=device ...]
// Exit status: 0 when the directory loads without errors and every device injects; 1 otherwise.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
	specs "tags.cncf.io/container-device-interface/specs-go"
)

type version struct {
	Declared string `json:"declared"`
	Minimum  string `json:"minimum"`
}

type report struct {
	Errors   map[string][]string `json:"errors"`
	Devices  []string            `json:"devices"`
	Versions map[string]version  `json:"versions"`
	Injected *oci.Spec           `json:"injected,omitempty"`
	Inject   string              `json:"inject_error,omitempty"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cdi-check SPEC_DIR [vendor/class=device ...]")
		os.Exit(2)
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(os.Args[1]), cdi.WithAutoRefresh(false))
	out := report{Errors: map[string][]string{}, Versions: map[string]version{}}
	if err != nil {
		out.Errors["(cache)"] = []string{err.Error()}
	}
	if cache != nil {
		for path, errs := range cache.GetErrors() {
			for _, e := range errs {
				out.Errors[path] = append(out.Errors[path], e.Error())
			}
		}
		out.Devices = cache.ListDevices()
		sort.Strings(out.Devices)
		for _, vendor := range cache.ListVendors() {
			for _, spec := range cache.GetVendorSpecs(vendor) {
				minimum, err := specs.MinimumRequiredVersion(spec.Spec)
				if err != nil {
					out.Errors[spec.GetPath()] = append(out.Errors[spec.GetPath()], err.Error())
				}
				out.Versions[spec.GetPath()] = version{Declared: spec.Version, Minimum: minimum}
			}
		}
		if len(os.Args) > 2 {
			spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
			if _, err := cache.InjectDevices(spec, os.Args[2:]...); err != nil {
				out.Inject = err.Error()
			} else {
				out.Injected = spec
			}
		}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if len(out.Errors) > 0 || out.Inject != "" {
		os.Exit(1)
	}
}
