// Command installtest writes a module proxy, the file tree that GOPROXY
// reads (file://...), holding the module of a directory: its .mod, .info
// and .zip (made by golang.org/x/mod/zip, as the Go module proxy makes
// them) and @latest. clients/go/test serves the client from it to a
// scratch module outside the repository, which gets it with go get as
// users do.
//
//	go run . -dir .. -out /tmp/proxy   # prints the version it wrote
//
// The version is a pseudo-version named by a hash of the files, so a
// changed file gets a new version (the module cache keeps the old one
// under the old name) and unchanged files the same.
package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/zip"
)

func main() {
	dir := flag.String("dir", "..", "the module's directory (where its go.mod is)")
	out := flag.String("out", "", "the proxy's directory, created if missing")
	flag.Parse()
	if *out == "" {
		log.Fatal("installtest: -out is required")
	}
	version, err := writeProxy(*dir, *out)
	if err != nil {
		log.Fatalf("installtest: %v", err)
	}
	fmt.Println(version)
}

// writeProxy writes the module at dir into the proxy tree at out and
// returns its version.
func writeProxy(dir, out string) (string, error) {
	gomod, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return "", err
	}
	path := modfile.ModulePath(gomod)
	files, err := moduleFiles(dir)
	if err != nil {
		return "", err
	}
	version, err := contentVersion(files)
	if err != nil {
		return "", err
	}
	var archive bytes.Buffer
	if err := zip.Create(&archive, module.Version{Path: path, Version: version}, files); err != nil {
		return "", err
	}
	escaped, err := module.EscapePath(path)
	if err != nil {
		return "", err
	}
	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)})
	if err != nil {
		return "", err
	}
	at := filepath.Join(out, filepath.FromSlash(escaped), "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		return "", err
	}
	for name, content := range map[string][]byte{
		filepath.Join(at, version+".mod"):                          gomod,
		filepath.Join(at, version+".info"):                         info,
		filepath.Join(at, version+".zip"):                          archive.Bytes(),
		filepath.Join(at, "list"):                                  nil, // no release: @latest answers
		filepath.Join(out, filepath.FromSlash(escaped), "@latest"): info,
	} {
		if err := os.WriteFile(name, content, 0o644); err != nil {
			return "", err
		}
	}
	return version, nil
}

// moduleFiles lists the files of the module at dir that its zip holds
// (not those of nested modules, vendor or VCS directories).
func moduleFiles(dir string) ([]zip.File, error) {
	checked, err := zip.CheckDir(dir)
	if err != nil {
		return nil, err
	}
	files := make([]zip.File, len(checked.Valid))
	for i, path := range checked.Valid { // dir joined with the file's path in the module
		rel, err := filepath.Rel(dir, path)
		if err != nil {
			return nil, err
		}
		files[i] = dirFile{rel: filepath.ToSlash(rel), path: path}
	}
	return files, nil
}

// contentVersion is a pseudo-version whose revision is a hash of the
// files' names and contents.
func contentVersion(files []zip.File) (string, error) {
	h := sha256.New()
	for _, f := range files {
		r, err := f.Open()
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s\x00", f.Path())
		_, err = io.Copy(h, r)
		r.Close()
		if err != nil {
			return "", err
		}
	}
	return "v0.0.0-00010101000000-" + hex.EncodeToString(h.Sum(nil))[:12], nil
}

// dirFile is a file of the module's directory as zip.Create takes it.
type dirFile struct{ rel, path string }

func (f dirFile) Path() string                 { return f.rel }
func (f dirFile) Lstat() (os.FileInfo, error)  { return os.Lstat(f.path) }
func (f dirFile) Open() (io.ReadCloser, error) { return os.Open(f.path) }
