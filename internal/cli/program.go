package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
)

// Exit codes of cfguard's commands.
const (
	ExitOK    = 0
	ExitError = 1
	ExitUsage = 2 // bad flags or arguments (ErrUsage), or what Program.IsUsage says
)

// Command is one subcommand: its name, a synopsis of its arguments, one line of help, and what
// it runs.
type Command struct {
	Name, Args, Help string
	Run              func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

// Program is a command made of subcommands, as `cfguard run ...`.
type Program struct {
	Name     string // the binary's name, as typed
	Intro    string // the usage's first line
	Outro    string // printed after the list of commands
	Commands []Command
	// IsUsage reports other errors that exit with ExitUsage (cfguard: an invalid configuration).
	// ErrUsage always does.
	IsUsage func(error) bool
}

// Usage prints the intro, every command with its synopsis and help, and the outro.
func (p Program) Usage(w io.Writer) {
	fmt.Fprintf(w, "%s\n\nUsage:\n", p.Intro)
	for _, c := range p.Commands {
		fmt.Fprintf(w, "  %s %s %s\n      %s\n", p.Name, c.Name, c.Args, c.Help)
	}
	fmt.Fprintf(w, "\n%s\n", p.Outro)
}

// Run runs the command args[0] names and returns the process's exit code: ExitOK on success or
// -h (help CMD runs CMD --help), ExitUsage for a usage error (printed with the command's name) or no or an unknown command
// (with the usage), ExitError otherwise.
func (p Program) Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 1 && args[0] == "help" && args[1] != "help" && args[1] != "-h" && args[1] != "--help" {
		// help CMD is CMD --help: the command's own flags, not the list of commands.
		return p.Run(ctx, []string{args[1], "--help"}, stdout, stderr)
	}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		p.Usage(stdout)
		if len(args) == 0 {
			return ExitUsage
		}
		return ExitOK
	}
	for _, c := range p.Commands {
		if c.Name != args[0] {
			continue
		}
		err := c.Run(ctx, args[1:], stdout, stderr)
		switch {
		case err == nil, errors.Is(err, flag.ErrHelp):
			return ExitOK
		case errors.Is(err, ErrUsage), p.IsUsage != nil && p.IsUsage(err):
			fmt.Fprintf(stderr, "%s %s: %v\n", p.Name, c.Name, err)
			return ExitUsage
		default:
			fmt.Fprintf(stderr, "%s %s: %v\n", p.Name, c.Name, err)
			return ExitError
		}
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n\n", p.Name, args[0])
	p.Usage(stderr)
	return ExitUsage
}
