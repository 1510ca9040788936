// cdi-check loads a CDI spec directory with the reference CDI library (Debian's packaged
// container-device-interface, GOPATH mode) and prints what a container runtime would see:
// every validation error the library records, and, for the qualified device names given as
// arguments, the OCI spec after injection, as JSON on stdout.
//
// Usage: cdi-check SPEC_DIR [vendor/class=device ...]
// Exit status: 0 when the directory loads without errors and every device injects; 1 otherwise.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/container-orchestrated-devices/container-device-interface/pkg/cdi"
	oci "github.com/opencontainers/runtime-spec/specs-go"
)

type report struct {
	Errors   map[string][]string `json:"errors"`
	Devices  []string            `json:"devices"`
	Injected *oci.Spec           `json:"injected,omitempty"`
	Inject   string              `json:"inject_error,omitempty"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: cdi-check SPEC_DIR [vendor/class=device ...]")
		os.Exit(2)
	}
	cache, err := cdi.NewCache(cdi.WithSpecDirs(os.Args[1]), cdi.WithAutoRefresh(false))
	out := report{Errors: map[string][]string{}}
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
