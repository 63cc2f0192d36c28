from . import run_main

run_main()
