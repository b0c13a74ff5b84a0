package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"

	"github.com/kvsource/kvsource/picker/calibrate"
)

func init() {
	commands["calibrate"] = command{summary: "measure recompute versus pull on a live pod pair and fit the threshold", run: runCalibrate}
}

func runCalibrate(args []string, _ io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kvsource calibrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kvsource calibrate --consumer URL --source URL --model NAME [--source-p2p HOST:PORT]")
		fmt.Fprintln(stderr, "                          [--consumer-metrics URL] [--lengths 2048,8192,...] [--repeats N]")
		fmt.Fprintln(stderr, "                          [--calibration FILE] [--json] [--progress auto|always|never]")
		fs.PrintDefaults()
	}
	cfg, err := calibrate.ParseFlags(fs, args)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kvsource calibrate: %v\n", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := calibrate.Run(ctx, cfg, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "kvsource calibrate: %v\n", err)
		return 1
	}
	return 0
}
