"""`python -m oled.cli`: the `oled` command line."""

from oled.cli import main

main()
