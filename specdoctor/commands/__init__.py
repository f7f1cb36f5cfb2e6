"""One module per command: parse its flags, run it, render what it found."""
