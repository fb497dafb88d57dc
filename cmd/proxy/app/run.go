package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

	"go.uber.org/zap"

	"github.com/pdproxy/pdproxy/kvbackend/sim"
)

// Run is the whole command: `proxy [flags]` serves until ctx is done (SIGINT/SIGTERM), then
// shuts down gracefully; `proxy sim [flags]` runs one simulated engine. It returns the exit code.
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
	if err := m.Start(ctx); err != nil {
		fmt.Fprintln(stderr, "proxy:", err)
		return 1
	}
	<-ctx.Done()
	logger.Info("shutting down", zap.Duration("drain_deadline", cfg.ShutdownTimeout))
	if err := m.Shutdown(context.Background()); err != nil {
		logger.Error("shutdown", zap.Error(err))
		return 1
	}
	logger.Info("stopped")
	return 0
}
