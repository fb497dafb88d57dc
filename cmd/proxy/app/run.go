package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/sim"
)

// Run is the whole command: `proxy [flags]` serves until ctx is done (SIGINT/SIGTERM), then
// shuts down gracefully, and reloads its --config file on SIGHUP; `proxy sim [flags]` runs one
// simulated engine. It returns the exit code.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "sim" {
		if err := sim.RunCommand(ctx, args[1:], stdout, stderr); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return 0
			}
			fmt.Fprintln(stderr, "proxy sim:", err)
			return 2
		}
		return 0
	}
	cfg, err := LoadConfig(args, stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintln(stderr, "proxy:", err)
		return 2
	}
	cfg.setDefaults()
	logger, err := NewLogger(cfg.LogFormat, cfg.LogLevel)
	if err != nil {
		fmt.Fprintln(stderr, "proxy:", err)
		return 2
	}
	defer logger.Sync()
	m, err := New(cfg, logger)
	if err != nil {
		fmt.Fprintln(stderr, "proxy:", err)
		return 1
	}
	// Caught before Start says the proxy listens: a SIGHUP from then on reloads, it never
	// kills the process.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	if err := m.Start(ctx); err != nil {
		fmt.Fprintln(stderr, "proxy:", err)
		return 1
	}
	reloads := make(chan struct{})
	go func() {
		defer close(reloads)
		reloadOnSignal(ctx, m, hup, cfg.Source.File, logger)
	}()
	<-ctx.Done()
	<-reloads
	logger.Info("shutting down", zap.Duration("drain_deadline", cfg.ShutdownTimeout))
	if err := m.Shutdown(context.Background()); err != nil {
		logger.Error("shutdown", zap.Error(err))
		return 1
	}
	logger.Info("stopped")
	return 0
}

// reloadOnSignal reloads the --config file on every SIGHUP until ctx is done. A rejected
// file is logged and the running config stays.
func reloadOnSignal(ctx context.Context, m *Main, hup <-chan os.Signal, file string, logger *zap.Logger) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
		}
		if file == "" {
			logger.Warn("sighup: nothing to reload, the proxy was started without --config")
			continue
		}
		if err := m.Reload(file); err != nil {
			logger.Error("config reload rejected, the running config stays", zap.String("file", file), zap.Error(err))
		}
	}
}
