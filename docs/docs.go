// Package docs holds cfguard's documentation, and gives the daemon the runbook it serves (Runbook).
// Its tests check what the Markdown files of the repository point at: every link leads somewhere
// (the file or directory exists, and a #fragment names a heading of the file it points into, or an
// <a id>, as GitHub renders them), and every test they name is one of the repository's, in the
// package they name.
package docs

import _ "embed"

// Runbook is RUNBOOK.md, one section per alert, which the web UI serves at /ui/runbook so that
// an operator reads it where the daemon runs, without a network beyond it.
//
//go:embed RUNBOOK.md
var Runbook string
