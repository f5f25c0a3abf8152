from rose.cli import main

if __name__ == "__main__":  # not when a spawned process (a bench feeder) imports it
    main()
