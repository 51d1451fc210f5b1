// Command cfguard keeps counterfactual explanations honest while the model behind them keeps
// learning. Its subcommands live in cmd/cfguard/internal/command.
package main

import "github.com/cfguard/cfguard/cmd/cfguard/internal/command"

func main() { command.Main() }
