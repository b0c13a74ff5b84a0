// Command kvsource is the command-line face of the kvsource SDK: it hashes
// prompts exactly as vLLM does (kvsource hash) and runs the events, index and
// picker as an HTTP service for routers not written in Go (kvsource serve).
package main

import (
	"fmt"
	"io"
	"os"
)

type command struct {
	summary string
	run     func(args []string, stdin io.Reader, stdout, stderr io.Writer) int
}

var commands = map[string]command{}

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stderr)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	c, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "kvsource: unknown command %q\n", args[0])
		usage(stderr)
		return 2
	}
	return c.run(args[1:], stdin, stdout, stderr)
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: kvsource <command> [flags]")
	fmt.Fprintln(w, "commands:")
	for _, name := range []string{"hash", "serve", "calibrate"} {
		if c, ok := commands[name]; ok {
			fmt.Fprintf(w, "  %-9s %s\n", name, c.summary)
		}
	}
}
