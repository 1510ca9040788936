package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/informers"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/features"

	utilfeature "k8s.io/apiserver/pkg/util/feature"
)

// runEvict runs kube-controller-manager's device taint eviction controller
// (pkg/controller/devicetainteviction) against a server, wired as kube-controller-manager
// wires it (its informers from one shared factory, its own client, the gates it requires):
// it deletes pods using a device with a NoExecute taint they do not tolerate, after adding
// the DisruptionTarget condition. Prints one "ready" line once its informers have synced;
// stops on SIGTERM or EOF on stdin.
func runEvict(args []string) error {
	fs := flag.NewFlagSet("evict", flag.ExitOnError)
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig of the API server")
	gates := fs.String("feature-gates", "", "kube-controller-manager --feature-gates")
	workers := fs.Int("workers", 10, "concurrent syncs (kube-controller-manager's default is 10)")
	verbosity := fs.String("v", "2", "klog verbosity (logs go to stderr)")
	fs.Parse(args)
	if *kubeconfig == "" {
		return fmt.Errorf("--kubeconfig is required")
	}
	if err := setGates(*gates); err != nil {
		return err
	}
	klogFlags := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(klogFlags)
	klogFlags.Set("v", *verbosity)
	// kube-controller-manager starts this controller only with both gates on; a harness
	// that ran it anyway would evict where a real cluster does not.
	on := utilfeature.DefaultFeatureGate.Enabled
	if !on(features.DynamicResourceAllocation) || !on(features.DRADeviceTaints) {
		return fmt.Errorf("feature gates DynamicResourceAllocation and DRADeviceTaints must be on: " +
			"kube-controller-manager starts the device taint eviction controller only then")
	}
	client, err := clientFromKubeconfig(*kubeconfig)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(klog.NewContext(context.Background(), klog.Background()))
	defer cancel()
	go func() {
		signals := make(chan os.Signal, 1)
		signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
		<-signals
		cancel()
	}()
	go func() {
		// EOF on stdin: the caller went away.
		buf := make([]byte, 512)
		for {
			if _, err := os.Stdin.Read(buf); err != nil {
				cancel()
				return
			}
		}
	}()

	factory := informers.NewSharedInformerFactory(client, 0)
	run, err := deviceTaintEvictionController(client, factory, *workers)
	if err != nil {
		return err
	}
	factory.Start(ctx.Done())
	done := make(chan struct{})
	go func() {
		defer close(done)
		run(ctx)
	}()
	syncCtx, syncCancel := context.WithTimeout(ctx, 60*time.Second)
	defer syncCancel()
	var unsynced []string
	for informer, synced := range factory.WaitForCacheSync(syncCtx.Done()) {
		if !synced {
			unsynced = append(unsynced, informer.String())
		}
	}
	if len(unsynced) > 0 {
		sort.Strings(unsynced)
		return fmt.Errorf("informers not synced within 60s: %s (a 1.34 server must serve "+
			"resource.k8s.io/v1alpha3 for DeviceTaintRules)", strings.Join(unsynced, ", "))
	}
	emit(map[string]any{"ready": true, "pid": os.Getpid(), "kubernetes": kubernetesVersion})
	<-done
	factory.Shutdown()
	return nil
}
