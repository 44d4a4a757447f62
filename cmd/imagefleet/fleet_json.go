package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
)

// jsonIndent is the indentation of the CLI's JSON documents (json.MarshalIndent(v, "", jsonIndent)).
const jsonIndent = "  "

// jsonList writes one JSON object whose first field is a list, byte for byte as json.MarshalIndent(object,
// "", jsonIndent) writes it, without holding the list: the elements are written as they come (add), the
// object's other fields once they are known (close). Every value, the list's key included, is encoding/json's;
// jsonList adds only the list's brackets, commas and indentation around them.
type jsonList struct {
	w      io.Writer
	field  string
	opened bool
	n      int // elements written
}

// open writes the object's start, up to the list's opening bracket (add and close open it if need be).
func (l *jsonList) open() error {
	if l.opened {
		return nil
	}
	l.opened = true
	key, err := json.Marshal(l.field)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(l.w, "{\n%s%s: [", jsonIndent, key)
	return err
}

// add writes one element of the list.
func (l *jsonList) add(v any) error {
	if err := l.open(); err != nil {
		return err
	}
	raw, err := json.MarshalIndent(v, jsonIndent+jsonIndent, jsonIndent)
	if err != nil {
		return err
	}
	sep := ","
	if l.n == 0 {
		sep = ""
	}
	l.n++
	_, err = fmt.Fprintf(l.w, "%s\n%s%s", sep, jsonIndent+jsonIndent, raw)
	return err
}

// close ends the list and writes the fields of rest, a value that marshals to a JSON object without the
// list's field, after it; then the object's end and a newline.
func (l *jsonList) close(rest any) error {
	if err := l.open(); err != nil {
		return err
	}
	raw, err := json.MarshalIndent(rest, "", jsonIndent)
	if err != nil {
		return err
	}
	fields, ok := bytes.CutPrefix(raw, []byte("{"))
	if !ok {
		return fmt.Errorf("the rest of %q's object is not an object: %.20s", l.field, raw)
	}
	end := "]"
	if l.n > 0 {
		end = "\n" + jsonIndent + "]"
	}
	if string(fields) == "}" { // no other field
		_, err = fmt.Fprintf(l.w, "%s\n}\n", end)
		return err
	}
	_, err = fmt.Fprintf(l.w, "%s,%s\n", end, fields)
	return err
}
