package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
	"k8s.io/kubernetes/cmd/kube-scheduler/app/options"

	basecompatibility "k8s.io/component-base/compatibility"
	logsapi "k8s.io/component-base/logs/api/v1"
)

// runScheduler runs kube-scheduler as its command does (cmd/kube-scheduler/app: its options,
// flags, feature gates, default profile with every in-tree plugin, DynamicResources
// included), against one API server: no leader election (one scheduler per server) and no
// HTTPS endpoint (nothing reads its healthz; --secure-port=0 also skips delegated authn/authz
// lookups). Every kube-scheduler flag is accepted after these defaults, e.g.
// --feature-gates. Prints {"ready": true} once its informers and event handlers have synced,
// then schedules until SIGTERM or EOF on stdin.
func runScheduler(args []string) error {
	opts := options.NewOptions()
	fs := pflag.NewFlagSet("scheduler", pflag.ContinueOnError)
	for _, set := range opts.Flags.FlagSets {
		fs.AddFlagSet(set)
	}
	defaults := []string{"--leader-elect=false", "--secure-port=0"}
	if err := fs.Parse(append(defaults, args...)); err != nil {
		return err
	}
	// What the command's PersistentPreRunE and runCommand do before Setup.
	if err := opts.ComponentGlobalsRegistry.Set(); err != nil {
		return err
	}
	gate := opts.ComponentGlobalsRegistry.FeatureGateFor(basecompatibility.DefaultKubeComponent)
	if err := logsapi.ValidateAndApply(opts.Logs, gate); err != nil {
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
	cc, sched, err := app.Setup(ctx, opts)
	if err != nil {
		return err
	}
	// app.Run starts the same informers and waits for the same syncs before scheduling;
	// doing it first here only lets the caller know when that point is reached (a factory
	// starts an informer once, and a second wait returns at once).
	cc.InformerFactory.Start(ctx.Done())
	if cc.DynInformerFactory != nil {
		cc.DynInformerFactory.Start(ctx.Done())
	}
	syncCtx, syncCancel := context.WithTimeout(ctx, 60*time.Second)
	defer syncCancel()
	for informer, synced := range cc.InformerFactory.WaitForCacheSync(syncCtx.Done()) {
		if !synced {
			return fmt.Errorf("informer %v not synced within 60s", informer)
		}
	}
	if cc.DynInformerFactory != nil {
		cc.DynInformerFactory.WaitForCacheSync(syncCtx.Done())
	}
	if err := sched.WaitForHandlersSync(syncCtx); err != nil {
		return fmt.Errorf("scheduler handlers not synced: %w", err)
	}
	emit(map[string]any{"ready": true, "pid": os.Getpid(), "kubernetes": kubernetesVersion})
	err = app.Run(ctx, cc, sched)
	if ctx.Err() != nil {
		return nil // stopped as asked: Run always ends with an error
	}
	return err
}
