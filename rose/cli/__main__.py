from rose.cli import main

main()
