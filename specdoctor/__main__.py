from specdoctor.cli import main

main()
