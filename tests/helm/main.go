// Command helm is Helm's own command line, built from the pinned helm.sh/helm/v4 module so the
// chart tests (tests/helm/) lint, render, install, upgrade and uninstall
// deploy/helm/gpu-node-agent with a known Helm, not whatever a machine has installed. The
// test bed's API server takes a token from a kubeconfig, so no cloud auth plugins are linked.
package main

import (
	"errors"
	"fmt"
	"os"

	helmcmd "helm.sh/helm/v4/pkg/cmd"
	"helm.sh/helm/v4/pkg/kube"
)

func main() {
	// Name the field manager explicitly so it does not depend on the binary's file name.
	kube.ManagedFieldsManager = "helm"
	root, err := helmcmd.NewRootCmd(os.Stdout, os.Args[1:], helmcmd.SetupLogging)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helm:", err)
		os.Exit(1)
	}
	if err := root.Execute(); err != nil {
		// Keep Helm's own exit codes (e.g. a failing post-renderer's) visible to callers.
		if cerr, ok := errors.AsType[helmcmd.CommandError](err); ok {
			os.Exit(cerr.ExitCode)
		}
		os.Exit(1)
	}
}
