//go:build tools

// Package tools names the command this module builds, so go mod tidy keeps its dependencies.
package tools

import (
	_ "github.com/bojand/ghz/cmd/ghz"
)
