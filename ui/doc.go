// Package ui is cfguard's read-only web UI: server-rendered HTML pages, under /ui/ on the API's
// listener, for the people who answer for the explanations (the posterior's history, the stored
// counterfactuals with their certificates and histories, a printable certificate of validity,
// and the events waiting to be published).
//
// The package renders what a Source reads; it changes nothing. Every page works without
// JavaScript, every asset is embedded in the binary, and a status is always written out in words
// beside its colour. With an API token configured, a page needs the token, as a bearer header or
// through a session cookie set by the login form (see Handler); the token never travels in a URL.
package ui
