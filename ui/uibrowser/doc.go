// Package uibrowser tests the web UI in a real browser: Debian's chromium, driven headless over
// the DevTools protocol, against a real daemon. It has tests only.
package uibrowser
